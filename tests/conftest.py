"""Settings every test shares: deterministic property tests, seeded random generators.

Hypothesis profiles, chosen by ``OVERLAPKIT_HYPOTHESIS_PROFILE`` (``ci`` when unset):

- ``ci`` (``make test``, ``.ci/run``): derandomized, so a commit draws the same examples on every
  run and CI passes or fails alike each time; no example database, so nothing left over from an
  earlier run changes what is drawn. A failure found by exploration is kept as an ``@example``.
- ``fuzz`` (``make fuzz``): fresh random examples on every run and ten times as many; failures go
  to the local database (``.hypothesis/``, git-ignored) and are replayed first on the next run,
  and hypothesis prints the reproducing ``@reproduce_failure`` blob.

A test that sets ``max_examples`` itself keeps it under both profiles.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

PROFILE_ENV = "OVERLAPKIT_HYPOTHESIS_PROFILE"
CI_EXAMPLES = 150

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=CI_EXAMPLES,
)
settings.register_profile("fuzz", deadline=None, print_blob=True, max_examples=10 * CI_EXAMPLES)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))


@pytest.fixture(scope="session")
def recipe_sweep(tmp_path_factory):
    """``overlapkit-train -m`` over every 2-rank recipe, run once for the tests that read it
    (tests/test_train_e2e.py checks each recipe; test_train_parallel_nd.py takes ddp on 2 ranks
    as a reference): a launch costs seconds of process start-up for a fraction of a second of
    training."""
    from tests.test_train_e2e import run_recipe_sweep

    return run_recipe_sweep(tmp_path_factory.mktemp("recipe_sweep"))


@pytest.fixture(scope="session")
def four_rank_sweep(tmp_path_factory):
    """``overlapkit-train -m`` over the 4-rank layouts, profiled, one rank of its ddp job slowed,
    run once for the tests that read it (tests/test_train_parallel_nd.py checks each layout;
    test_stragglers_real.py the straggler analysis of the slowed job)."""
    from tests.test_train_parallel_nd import run_four_rank_sweep

    return run_four_rank_sweep(tmp_path_factory.mktemp("four_rank_sweep"))


@pytest.fixture(scope="session")
def one_process_layouts(tmp_path_factory):
    """The 4-rank layouts against one process, run once in one launch
    (tests/one_process_layouts.py); with the directory of the pipeline's profiled case."""
    from tests.one_process_layouts import run_one_process_layouts

    profile_dir = tmp_path_factory.mktemp("one_process_layouts")
    return run_one_process_layouts(profile_dir), profile_dir


@pytest.fixture(autouse=True)
def _seeded_generators() -> None:
    """Seed Python's, NumPy's and torch's global generators before each test, so a test that
    draws from them without its own seed still sees the same numbers whatever ran before it."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
