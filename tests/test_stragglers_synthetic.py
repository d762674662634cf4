"""Stragglers injected into synthetic runs are named with their cause and their true cost.

Each case is a random run of ``bench.harness.synthetic_run`` (NCCL GPU-shaped or gloo CPU-shaped
traces, 2 to 12 ranks, blocking or DDP-like collectives, clocks off by up to 3 s, hosts of 1, 2
or 4 ranks) with one to three injected stragglers (a slower op, a host gap, data loading, a slow
transfer; 0.5 to 5 ms; several in one step or collective). The truth is the simulator's: a
straggler's cost is the run's time with every injection less the run's time without that one.
The analysis sees only the trace files.

A straggler counts as named when the report has an entry for its rank, step and collective (for
a slow transfer, the collective whose transfer was slow) with its cause; its ``cost_ms`` must be
within 5 % of the true cost, or within the analysis's floor of 10 µs for a delay the other ranks
(almost) absorbed.

Under ``make test`` the 200 cases are the same every run (seeds 0..199); ``make fuzz``
(``OVERLAPKIT_HYPOTHESIS_PROFILE=fuzz``) draws 2,000 fresh seeds and prints the failing ones.
"""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest

from bench.harness.synthetic_run import CAUSES, Injection, RunSpec, write_run
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.stragglers import FLOOR_US, find_stragglers
from tests.conftest import PROFILE_ENV

EXPLORING = os.environ.get(PROFILE_ENV, "ci") != "ci"
SEEDS = [random.SystemRandom().randrange(2**32) for _ in range(2000)] if EXPLORING else range(200)
NAMED_SHARE = 0.99
COST_TOLERANCE = 0.05
FLOOR_MS = FLOOR_US / 1e3


def random_case(seed: int) -> RunSpec:
    """The run of one case (everything drawn from ``seed``)."""
    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(2, 13))
    steps = int(rng.integers(3, 7))
    positions = int(rng.integers(1, 4))
    spots = {
        (int(rng.integers(ranks)), int(rng.integers(1, steps + 1)), int(rng.integers(positions)))
        for _ in range(int(rng.integers(1, 4)))
    }
    injections = tuple(
        Injection(
            rank=rank,
            step=step,
            position=position,
            cause=str(rng.choice(CAUSES)),
            delay_ms=float(rng.uniform(0.5, 5.0)),
            op=int(rng.integers(3)),
        )
        for rank, step, position in sorted(spots)
    )
    return RunSpec(
        ranks=ranks,
        steps=steps,
        backend=str(rng.choice(["nccl", "gloo"])),
        collectives_per_step=positions,
        ops_per_segment=int(rng.integers(1, 4)),
        blocking=bool(rng.integers(2)),
        jitter=float(rng.uniform(0.0, 0.003)),
        clock_offset_s=float(rng.uniform(0.0, 3.0)),
        ranks_per_host=int(rng.choice([1, 2, 4])),
        seed=seed,
        injections=injections,
    )


def _matches(straggler, injection: Injection) -> bool:
    if straggler.rank != injection.rank:
        return False
    where = f"all_reduce #{injection.position}"
    if injection.cause == "comm":
        return straggler.cause == "comm" and straggler.cause_collective == (
            f"{where} of step {injection.step}"
        )
    return (straggler.step, straggler.collective, straggler.cause) == (
        injection.step,
        where,
        injection.cause,
    )


def check_case(seed: int, directory) -> tuple[int, int, list[str]]:
    """(injected, named with the right cause and cost, what went wrong) for one case."""
    spec = random_case(seed)
    truth = write_run(spec, directory)
    found = find_stragglers(analyze_run(directory, programs=True, jobs=1).programs, what_if=False)
    named, problems = 0, []
    for injection, cost in zip(spec.injections, truth.costs_ms, strict=True):
        hits = [s for s in found.stragglers if _matches(s, injection)]
        if not hits:
            problems.append(f"seed {seed}: {injection} not named (true cost {cost:.3f} ms)")
            continue
        error = abs(hits[0].cost_ms - cost)
        if error > max(COST_TOLERANCE * cost, FLOOR_MS):
            problems.append(
                f"seed {seed}: {injection} cost {hits[0].cost_ms:.4f} ms, true {cost:.4f} ms"
            )
            continue
        named += 1
    return len(spec.injections), named, problems


@pytest.mark.timeout(3600 if EXPLORING else 180)  # exploring: ten times the cases
def test_injected_stragglers_are_named_with_their_cause_and_cost_in_99_percent_of_cases(
    tmp_path,
):
    injected = named = 0
    problems: list[str] = []
    for seed in SEEDS:
        directory = tmp_path / f"case{seed}"
        n, ok, why = check_case(seed, directory)
        injected, named = injected + n, named + ok
        problems += why
        for path in directory.iterdir():
            path.unlink()
    print(f"{named} of {injected} injected stragglers named right in {len(SEEDS)} cases")
    print("\n".join(problems))
    assert len(SEEDS) >= 200 and injected >= 200
    assert named >= NAMED_SHARE * injected, problems


@pytest.mark.parametrize("seed", [3, 17])
def test_a_control_with_the_injections_left_out_of_the_traces_is_not_named(tmp_path, seed):
    """The check can fail: the same runs without injections name none of them."""
    spec = random_case(seed)
    write_run(dataclasses.replace(spec, injections=()), tmp_path)
    found = find_stragglers(analyze_run(tmp_path, programs=True, jobs=1).programs)
    assert found.stragglers == [], found.stragglers
    for injection in spec.injections:
        assert not any(_matches(s, injection) for s in found.stragglers)
