"""Every layout the overlapkit-train search can choose runs, and ``parallel=auto`` runs the winner.

The combinations come from the search itself (``autoplan.search.searched_layouts`` under
``framework=overlapkit-train``, on a 4-rank two-node CPU preset and an 8-GPU one, gpt_tiny and
moe_tiny): one layout per combination of parallel dimensions above 1, sharding and
interleaving, the smallest, with the recomputation modes (none, selective, full, full:1) dealt
round them. Each gets its ``run it:`` line (``train_overrides``), composed by Hydra from the
real config groups and put through overlapkit-train's pre-launch checks (``check_job``), and
read back into the same layout (``train.planning.planned.run_layout``). A scaled-down copy of each
(a 16-wide gpt_tiny, one step) then trains on 4 gloo ranks, all in one launch, together with
the job ``overlapkit-train parallel=auto`` hands to its launcher.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import overlapkit as ok
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.handoff.run_config import train_overrides
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.search import searched_layouts
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.layout import TrainingLayout
from overlapkit.topology import load_topology
from overlapkit.train.launch import cli
from overlapkit.train.launch.cli import check_job
from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.models import GPTConfig, MoEConfig
from overlapkit.train.parallel.mesh import split_parallel
from overlapkit.train.parallel.run_layout import run_layout
from overlapkit.train.planning.parallel_auto import RECORD_NAME
from tests.multiproc import run_on_ranks

SHAPE = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)  # conf/model
MODELS = {
    "gpt_tiny": GPTConfig(**SHAPE),
    "moe_tiny": MoEConfig(**SHAPE, n_expert=4, top_k=2, expert_hidden=256),
}
RECOMPUTE = ("none", "selective", "full", "full:1")
FULL_1 = {"recompute": "full", "recompute_layers": 1}
PINS = ({}, {"cp": 2}, FULL_1, {"cp": 2} | FULL_1)
"""The free search keeps at least 2,048 tokens per cp rank (64 here): cp is pinned to be seen."""
MULTINODE = ["launcher.node_rank=0", "launcher.rdzv_endpoint=127.0.0.1:29500"]
GPU = ok.load_topology("dgx-a100").accelerator


def host_yaml(path: Path, *, nodes: int, per_node: int, memory: str = "8GB", **host) -> Path:
    """A CPU host's topology file as ``overlapkit calibrate --host`` writes it (fixed figures)."""
    terms = {
        "collective_overhead": "1ms",
        "tp_layer_dispatch": "3ms",
        "optimizer_tensor": "40us",
        "optimizer_dtensor": "300us",
        "optimizer_param": "8ns",
        "overlap_efficiency": 0.5,
    } | host
    doc = {
        "name": path.stem,
        "library": "gloo",
        "nodes": nodes,
        "devices_per_node": per_node,
        "device_kind": "cpu",
        "scale_up": {"kind": "none", "links": 0, "bandwidth": "1GB/s", "latency": "500us"},
        "scale_out": {
            "kind": "fat-tree",
            "transport": "ethernet",
            "nics_per_node": 1,
            "nic_bandwidth": "0.1GB/s",
            "latency": "1ms",
        },
        "accelerator": {
            "name": "measured-host",
            "memory": memory,
            "peak_bf16_tflops": 0.01,
            "host": terms,
        },
    }
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


def _combination(layout: TrainingLayout, model: str) -> tuple:
    dims = tuple(d for d in ("tp", "pp", "cp", "ep", "dp") if layout.dims[d] > 1)
    return model if layout.ep > 1 else "gpt_tiny", dims, layout.sharding, layout.virtual_stages > 1


def _recompute(layout: TrainingLayout) -> str:
    return layout.recompute if layout.recompute_layers is None else "full:1"


@functools.cache
def combinations() -> dict[tuple, tuple[str, TrainingLayout]]:
    """(model, dims above 1, sharding, interleaved) -> (preset, the smallest layout), with the
    recompute modes dealt round the combinations in order."""
    settings = SearchSettings(framework=OVERLAPKIT_TRAIN)
    found: dict[tuple, dict[str, tuple[str, TrainingLayout]]] = {}
    for preset, topology in (
        ("cpu-gloox2", load_topology("cpu-gloox2").with_accelerator(GPU)),
        ("dgx-a100", load_topology("dgx-a100")),
    ):
        for model, config in MODELS.items():
            spec = train_model_spec(config, name=model)
            for pins in PINS:
                for layout in searched_layouts(
                    topology, spec, global_batch=16, seq_len=64, fixed=pins, settings=settings
                ):
                    size = (layout.world_size, layout.tp * layout.pp * layout.cp * layout.ep)
                    kinds = found.setdefault(_combination(layout, model), {})
                    best = kinds.get(_recompute(layout))
                    if best is None or size < (best[1].world_size, _model_size(best[1])):
                        kinds[_recompute(layout)] = (preset, layout)
    keys = sorted(found, key=str)
    return {key: found[key][RECOMPUTE[i % len(RECOMPUTE)]] for i, key in enumerate(keys)}


def _model_size(layout: TrainingLayout) -> int:
    return layout.tp * layout.pp * layout.cp * layout.ep


@functools.cache
def composed() -> dict[tuple, DictConfig]:
    """Each combination's ``run it:`` line composed from the config groups."""
    out = {}
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        for key, (preset, layout) in combinations().items():
            topology = load_topology(preset)
            overrides = train_overrides(
                layout,
                topology=preset,
                nodes=topology.num_nodes,
                ranks_per_node=len(topology.nodes()[0]),
                model=key[0],
                layers=SHAPE["n_layer"],
            )
            extra = MULTINODE if topology.num_nodes > 1 else []
            out[key] = compose(config_name="config", overrides=[*overrides, *extra])
    return out


def _layout_of(cfg: DictConfig, world_size: int) -> TrainingLayout | None:
    plan, factory = split_parallel(cfg.parallel)
    train = cfg.train
    return run_layout(
        plan,
        factory,
        batch_size=train.batch_size,
        grad_accum=train.grad_accum,
        recompute=train.recompute,
        recompute_layers=train.recompute_layers,
        world_size=world_size,
    )


def test_the_search_proposes_every_dimension_overlapkit_train_runs_and_only_those():
    keys = set(combinations())
    for expected in (
        ("gpt_tiny", ("pp", "dp"), "hsdp", True),  # 8 ranks: pp 2 x (2 replicas x 2 shards)
        ("gpt_tiny", ("tp", "pp", "dp"), "ddp", True),
        ("gpt_tiny", ("tp", "cp", "dp"), "ddp", False),
        ("gpt_tiny", ("cp", "dp"), "zero2", False),
        ("gpt_tiny", ("pp", "dp"), "zero1", False),
        ("moe_tiny", ("ep", "dp"), "ddp", False),
    ):
        assert expected in keys
    # What overlapkit-train refuses never comes up: pp with cp or ep, zero2 under pp, tp or ep
    # under FSDP, cp with ep or hsdp.
    for _, dims, sharding, _ in keys:
        assert not ({"pp", "cp"} <= set(dims) or {"pp", "ep"} <= set(dims))
        assert not ("pp" in dims and sharding == "zero2")
        assert not (({"tp", "ep"} & set(dims)) and sharding != "ddp")
        assert not ("cp" in dims and sharding == "hsdp")
    dealt = [_recompute(layout) for _, layout in combinations().values()]
    assert all(dealt.count(mode) >= 5 for mode in RECOMPUTE), dealt


def test_every_combinations_run_line_passes_the_checks_before_launch_and_runs_that_layout():
    for key, cfg in composed().items():
        preset, layout = combinations()[key]
        launcher = instantiate(cfg.launcher)
        check_job(cfg, launcher)  # what overlapkit-train checks before starting workers
        world_size = launcher.nnodes * launcher.nproc_per_node
        assert world_size == load_topology(preset).world_size, key
        assert _layout_of(cfg, world_size) == layout, key


COPY = {
    "model.config.n_embd": 16,
    "model.config.block_size": 16,
    "train.steps": 1,
    "train.batch_size": 2,
    "train.checkpoint_every": 0,
    "train.progress": False,
    "train.device": "cpu",
}


def scaled_copy(cfg: DictConfig, topology_file: Path, name: str) -> dict:
    """``cfg`` on 4 ranks (dp shrinks with the world): a 16-wide model, one step, no
    checkpoint, the micro-batches a pipeline needs."""
    job = OmegaConf.to_container(cfg, resolve=False)
    copy = OmegaConf.create(job)
    for key, value in COPY.items():
        OmegaConf.update(copy, key, value)
    plan, _ = split_parallel(copy.parallel)
    copy.train.grad_accum = plan.pp * plan.virtual_stages
    copy.topology.name_or_path = str(topology_file)
    copy.name = name
    check_job(copy, LauncherConfig(nproc_per_node=4))
    return OmegaConf.to_container(copy, resolve=False)


def _train_each(rank: int, world_size: int, jobs: list[dict], root: str) -> list[dict | None]:
    from overlapkit.train.run.loop import RunPaths, train

    summaries = []
    for index, job in enumerate(jobs):
        run_dir = Path(root) / str(index)
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = train(OmegaConf.create(job), RunPaths(run_dir, "t"), local_rank=rank)
        summaries.append(None if summary is None else asdict(summary) | {"text": summary.format()})
    return summaries


def _captured_auto_job(tmp_path: Path, monkeypatch, argv: list[str]) -> tuple[dict, Path]:
    """Run ``overlapkit-train parallel=auto ...`` (the Hydra app, its planning and checks) up to
    the launch, and return the job it hands to the launcher."""
    captured = {}

    def launch(job, run_dir, launcher):
        captured.update(job=job, run_dir=run_dir)

    monkeypatch.setattr(cli, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["overlapkit-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the error itself, not Hydra's exit
    monkeypatch.chdir(tmp_path)
    cli.main()
    return captured["job"], Path(captured["run_dir"])


AUTO = [
    "parallel=auto",
    "topology=preset",
    "launcher.nproc_per_node=4",
    "train.steps=3",
    "train.progress=false",
    "train.device=cpu",
    "model.config.n_embd=32",
    "hydra.run.dir=runs/auto",
]


def test_parallel_auto_plans_records_and_reuses_the_layout_and_refuses_a_changed_request(
    tmp_path, monkeypatch
):
    host = host_yaml(tmp_path / "host.yaml", nodes=1, per_node=4)
    argv = [*AUTO, f"topology.name_or_path={host}"]
    job, run_dir = _captured_auto_job(tmp_path, monkeypatch, argv)
    record = json.loads((run_dir / RECORD_NAME).read_text())
    assert record["request"]["global_batch"] == 8 * 4 and record["request"]["seq_len"] == 64
    # The job is the winner's: what ok.plan(..., auto=True) chooses for the same request.
    spec = train_model_spec(GPTConfig(**(SHAPE | {"n_embd": 32})), name="gpt_tiny")

    def winner():
        return ok.plan(
            load_topology(host),
            model=spec,
            global_batch=32,
            seq_len=64,
            auto=True,
            framework="overlapkit-train",
            precision="fp32",
        ).training

    best = winner()
    assert _layout_of(OmegaConf.create(job), 4) == best
    assert job["name"] == "gpt_tiny-auto" and job["train"]["steps"] == 3
    # Another host file now makes the planner choose otherwise; the rerun keeps the record.
    host_yaml(host, nodes=1, per_node=4, optimizer_tensor="100ms")
    moved = winner()
    assert moved != best
    again, _ = _captured_auto_job(tmp_path, monkeypatch, argv)
    assert _layout_of(OmegaConf.create(again), 4) == best
    # A changed request (another global batch) is refused with both named.
    with pytest.raises(ValueError, match=r"planned_layout.json holds the layout .*global_batch"):
        _captured_auto_job(tmp_path, monkeypatch, [*argv, "train.batch_size=4"])


def test_parallel_auto_refuses_a_topology_without_accelerator_and_a_model_that_fits_nowhere(
    tmp_path, monkeypatch
):
    for topology, message in (
        (["topology=detect"], "topology=detect describes the ranks only once they run"),
        (["topology.name_or_path=cpu-gloox2"], "topology 'cpu-gloox2' has none"),
    ):
        with pytest.raises(ValueError, match=message):
            _captured_auto_job(tmp_path, monkeypatch, [*AUTO, *topology])
    tiny = host_yaml(tmp_path / "tiny.yaml", nodes=1, per_node=4, memory="0.01GB")
    with pytest.raises(ValueError, match=r"fits nowhere .* the smallest layout .* needs"):
        _captured_auto_job(tmp_path, monkeypatch, [*AUTO, f"topology.name_or_path={tiny}"])


@pytest.mark.slow
def test_a_scaled_down_copy_of_every_combination_and_the_auto_winner_train_on_4_ranks(
    tmp_path, monkeypatch
):
    host = host_yaml(tmp_path / "two-nodes.yaml", nodes=2, per_node=2)
    jobs = [scaled_copy(cfg, host, f"copy{i}") for i, cfg in enumerate(composed().values())]
    one_node = host_yaml(tmp_path / "host.yaml", nodes=1, per_node=4)
    auto_job, run_dir = _captured_auto_job(
        tmp_path, monkeypatch, [*AUTO, f"topology.name_or_path={one_node}"]
    )
    summaries = run_on_ranks(
        _train_each, 4, [*jobs, auto_job], str(tmp_path / "runs"), total_timeout_s=900
    )[0]
    for key, job, summary in zip(composed(), jobs, summaries, strict=False):
        assert summary["steps_run"] == 1 and math.isfinite(summary["loss_last"]), key
        dims = key[1]
        assert ("pipeline" in summary["parallel"]) == ("pp" in dims), key
        assert ("context parallel" in summary["parallel"]) == ("cp" in dims), key
        layout = _layout_of(OmegaConf.create(job), 4)
        if layout is not None:  # every copy the planner can describe is priced
            assert summary["planned_layout"]["dims"] == layout.dims, key
            assert summary["predicted_step_s"] > 0 and summary["measured_step_s"] > 0, key
    auto = summaries[-1]
    record = json.loads((run_dir / RECORD_NAME).read_text())
    assert {k: v for k, v in auto["planned_layout"].items() if k != "text"} == record["layout"]
    assert auto["measured_step_s"] == pytest.approx(auto["median_step_ms"] / 1e3)
    last = auto["text"].splitlines()[-1]
    assert "predicted step" in last and "measured" in last and "measured / predicted" in last
    assert torch.isfinite(torch.tensor(auto["loss_last"]))
