# Each target installs what it needs into .venv first, so a fresh clone needs only `make test`.
PYTHON ?= python3
# The CPU build that lies on this machine. `TORCH_SPEC=torch==2.14.1 make test` (any pip
# requirement) builds and uses a venv of its own, .venv-torch-2.14.1, so .venv keeps its torch.
# A given TORCH_SPEC also goes with each install of the package, so that pip refuses one outside
# pyproject.toml's torch range (naming both) instead of upgrading torch behind its back.
ifeq ($(origin TORCH_SPEC),undefined)
TORCH_SPEC := torch==2.13.0
VENV := .venv
TORCH_PIN :=
else
VENV := .venv-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.' '-' | tr -s '-')
TORCH_PIN := "$(TORCH_SPEC)"
endif
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: install test test-fast test-gpu host-wheels test-gpu-host fuzz demo docs bench lint clean

install: $(STAMP)

# pip byte-compiles what it installs one file after another (about 30 s of a fresh `make
# install`); installing without, then one compileall on every core, writes the same .pyc in
# less. They must be written at install: with PYTHONDONTWRITEBYTECODE=1 (CI's shell sets it)
# Python writes none on import, and every process would compile torch again. Like pip's, the
# compile's errors are not the install's (torch ships a module only Python 3.12 parses).
PIP_INSTALL := $(PY) -m pip install --quiet --no-compile
COMPILE_SITE_PACKAGES := $(PY) -m compileall -q -j 0 \
	"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true

# The venv, and torch where it has none (an installed torch is kept: never a CUDA build by accident).
define VENV_WITH_TORCH
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
endef

# What `make demo` needs: the package and its dependencies, none of the extras.
$(BASE_STAMP): pyproject.toml
	$(VENV_WITH_TORCH)
	$(PIP_INSTALL) -e . $(TORCH_PIN)
	$(COMPILE_SITE_PACKAGES)
	touch $@

# torchtitan (pyproject's torchtitan extra) for the hand-off's acceptance test, without its
# dependencies: torch_checkpointing's install pulls triton (a 286 MB GPU compiler) and wandb.
# Only what its config, mesh and model-registry code imports: the no-torch-needed ones with
# their dependencies, the rest with --no-deps. ~200 MB (pyarrow, for `datasets`, is 176 of them). Python >= 3.11 only: elsewhere the test skips.
TORCHTITAN := torchtitan==0.3.0
TORCHTITAN_NO_DEPS := spmd_types==0.2.3 torchdata==0.11.0
TORCHTITAN_DEPS := tyro==1.0.17 "datasets>=3.6.0,<4.8.0"

# `make test` adds the test tools, the docs tools, HTA, the frameworks of overlapkit.integrations
# and torchtitan: what the base has and more, in one install and one compile (a fresh clone's
# `make test` installs once, not the base first).
$(STAMP): pyproject.toml
	$(VENV_WITH_TORCH)
	$(PIP_INSTALL) -e ".[dev,docs,hta,integrations]" $(TORCH_PIN)
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
	  $(PIP_INSTALL) --no-deps "$(TORCHTITAN)" $(TORCHTITAN_NO_DEPS) && \
	  $(PIP_INSTALL) $(TORCHTITAN_DEPS) $(TORCH_PIN); \
	else echo "torchtitan needs Python >= 3.11: tests/test_torchtitan_handoff.py skips its acceptance"; fi
	$(COMPILE_SITE_PACKAGES)
	touch $@ $(BASE_STAMP) $(DOCS_STAMP)

# `make docs` needs Zensical only.
$(DOCS_STAMP): $(BASE_STAMP)
	$(PIP_INSTALL) -e ".[docs]" $(TORCH_PIN)
	$(COMPILE_SITE_PACKAGES)
	touch $@

# The project's own modules compiled once up front, for the same reason as the venv's: under
# PYTHONDONTWRITEBYTECODE=1 each of the suite's hundreds of processes would compile them again.
COMPILE_PROJECT := $(PY) -m compileall -q -j 0 overlapkit tests bench recipes >/dev/null

# The docs are built first (strict): a broken link or a page missing from nav fails `make test`.
# Property tests draw the same examples on every run (tests/conftest.py, profile "ci")...
test: $(STAMP)
	$(DOCS_BUILD)
	$(COMPILE_PROJECT)
	OVERLAPKIT_HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q

test-fast: $(STAMP)
	$(COMPILE_PROJECT)
	OVERLAPKIT_HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow"

# On a GPU host: the whole suite, CUDA-only tests (marked `cuda`, skipped elsewhere) included;
# refuses to start without CUDA, so none of them is skipped silently. Skips are listed (-rs).
test-gpu: $(STAMP)
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: CUDA is not available here')"
	$(COMPILE_PROJECT)
	OVERLAPKIT_HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -rs

# On a GPU host whose torch is installed and pinned (a cluster's container; the lent H200's image
# has torch 2.11 and no Hydra): the same, with that host's own Python and torch, never installing
# or upgrading torch. `make host-wheels`, where the package index is reachable, puts the
# pure-Python dependencies such a host lacks into $(HOST_WHEELS) as wheels; carried there with the
# checkout, `make test-gpu-host` unpacks them into $(HOST_SITE) (--no-deps: pip checks no
# requirement, torch's neither) and runs the suite from the checkout with PYTHONPATH, leaving the
# host's environment as it was. Tests that need a newer torch skip naming the version
# (tests/torch_version.py; docs/development.md says what runs on which torch).
HOST_PYTHON ?= python3
HOST_WHEELS := wheels
HOST_SITE := .host-site
HOST_PACKAGES := hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3

host-wheels:
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(HOST_WHEELS) $(HOST_PACKAGES)

test-gpu-host:
	$(HOST_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu-host: CUDA is not available here')"
	$(HOST_PYTHON) -m pip install --quiet --no-index --no-deps --upgrade --target $(HOST_SITE) $(HOST_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(HOST_SITE) OVERLAPKIT_HYPOTHESIS_PROFILE=ci $(HOST_PYTHON) -m pytest -q -rs

# ...and `make fuzz` explores: fresh random examples, ten times as many. Keep what it finds as
# an @example beside the test.
FUZZ_TESTS := tests/test_fuzz_inputs.py tests/test_intervals.py tests/test_placement_properties.py \
	tests/test_interval_arrays.py tests/test_stragglers_synthetic.py
fuzz: $(STAMP)
	OVERLAPKIT_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q $(FUZZ_TESTS)

demo: $(BASE_STAMP)
	$(VENV)/bin/overlapkit-train recipe=demo

# The site (docs/ and mkdocs.yml) into site/ with Zensical, strict: any warning (a broken link
# or anchor) fails the build; a page missing from nav fails tests/test_docs_nav.py.
DOCS_BUILD = $(VENV)/bin/zensical build --strict
docs: $(DOCS_STAMP)
	$(DOCS_BUILD)

# Benchmarks print side-by-side ratios measured in one run; JSON copies go to bench/results/.
bench: $(STAMP)
	$(PY) -m bench.ddp_overlap --json bench/results/ddp_overlap_mlp.json
	$(PY) -m bench.ddp_overlap --model gpt_tiny --json bench/results/ddp_overlap_gpt_tiny.json
	$(PY) -m bench.fsdp_prefetch --json bench/results/fsdp_prefetch.json
	$(PY) -m bench.fsdp_prefetch --rate none --json bench/results/fsdp_prefetch_loopback.json
	$(PY) -m bench.cost_model --links none,8gbit --quantile 0.25 --fit-min-bytes 1MiB --json bench/results/cost_model.json
	$(PY) -m bench.placement --json bench/results/placement.json
	$(PY) -m bench.profile_overhead --json bench/results/profile_overhead.json
	$(PY) -m bench.profile_exposed --out runs/profile_exposed --json bench/results/profile_exposed.json
	# 8 ranks x 128 MB of GPU traces (written to the temp dir, deleted after), HTA beside; 1,024 ranks.
	$(PY) -m bench.trace_scale --thousand --json bench/results/trace_scale.json
	$(PY) -m bench.stragglers_real --json bench/results/stragglers_real.json
	$(PY) -m bench.autotune --json bench/results/autotune.json
	$(PY) -m bench.scaling --json bench/results/scaling.json
	$(PY) -m bench.compress_hooks --json bench/results/compress_hooks.json
	$(PY) -m bench.integrations_overlap --json bench/results/integrations_overlap.json
	$(PY) -m bench.fsdp_compile --json bench/results/fsdp_compile.json
	$(PY) -m bench.inlayer_overlap --json bench/results/inlayer_overlap.json
	# Exits 1 when the planner orders a pair beyond the noise the other way (docs/auto-planner.md).
	$(PY) -m bench.planner_ranking --rounds 9 --json bench/results/planner_ranking.json

lint: $(STAMP)
	$(VENV)/bin/ruff check overlapkit tests recipes bench
	$(VENV)/bin/ruff format --check overlapkit tests recipes bench

clean:
	rm -rf $(VENV) runs bench/results .pytest_cache site .cache $(HOST_SITE) $(HOST_WHEELS)
