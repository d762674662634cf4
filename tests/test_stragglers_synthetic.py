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

The noise the analysis measures is checked too, on longer runs (8 to 12 steps of 3
collectives, so that there is noise to measure). In a clean run whose ops, transfers and optimizer
steps jitter by a realistic 0.5 to 3 % (relative standard deviation), nothing is named. Where
the jitter is comparable to a delay (2 %, one op per segment), a longer op or transfer
within the noise (at most its standard deviation) is not named, since the other ranks vary as
much, and nothing else is; one far beyond it (20 standard deviations) is named with its cause,
its cost within ``COST_JITTERS`` standard deviations of the truth.

Under ``make test`` the cases are the same every run (seeds 0, 1, ...: ``CI_CASES`` per test);
``make fuzz`` (``OVERLAPKIT_HYPOTHESIS_PROFILE=fuzz``) draws ``FUZZ_CASES`` fresh seeds per test
and prints the failing ones; a seed it finds is kept in ``FOUND``.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from bench.harness.synthetic_run import CAUSES, Injection, RunSpec, Truth, write_run
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.stragglers import FLOOR_US, StragglerReport, find_stragglers
from tests.conftest import PROFILE_ENV

EXPLORING = os.environ.get(PROFILE_ENV, "ci") != "ci"
CI_CASES = {"injected": 60, "clean": 40, "within_noise": 30}
FUZZ_CASES = {"injected": 2000, "clean": 500, "within_noise": 500}
NAMED_SHARE = 0.99
COST_TOLERANCE = 0.05
FLOOR_MS = FLOOR_US / 1e3
REALISTIC_JITTER = (0.005, 0.03)
"""The relative standard deviation of every op, transfer and optimizer step in a clean run."""
COMPARABLE_JITTER = 0.02
WITHIN_NOISE, BEYOND_NOISE = 1.0, 20.0
"""Delays in standard deviations of the op or transfer they lengthen."""
COST_JITTERS = 5.0
"""The cost error allowed beyond the noise, in standard deviations: the excess removed is the
delay plus the rank's own jitter less its baseline's (for two ranks: sd sqrt(2) of them)."""
FOUND = {"clean": [106, 347961950, 1322258984, 2521827411]}
"""Cases exploration found failing, kept in every run (clean: noise of the longest segments, or
of a two-rank group's transfers, named with one noise figure for the whole run)."""


def seeds(test: str) -> Sequence[int]:
    """The cases of ``test``: the same ``CI_CASES`` every run, or ``FUZZ_CASES`` fresh ones, and
    the ones found before (``FOUND``)."""
    if EXPLORING:
        drawn = [random.SystemRandom().randrange(2**32) for _ in range(FUZZ_CASES[test])]
    else:
        drawn = list(range(CI_CASES[test]))
    return drawn + FOUND.get(test, [])


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


def _analyze(spec: RunSpec, directory: Path) -> tuple[Truth, StragglerReport]:
    """The run's truth and what the analysis finds in its traces (which are deleted after)."""
    truth = write_run(spec, directory)
    found = find_stragglers(analyze_run(directory, programs=True, jobs=1).programs, what_if=False)
    for path in directory.iterdir():
        path.unlink()
    return truth, found


def _miss(
    seed: int, injection: Injection, cost_ms: float, found: StragglerReport, tolerance_ms: float
) -> str | None:
    """What is wrong with how ``injection`` was named: not at all, or with a cost off the true
    ``cost_ms`` by more than ``COST_TOLERANCE`` of it, ``FLOOR_MS`` and ``tolerance_ms``."""
    hits = [s for s in found.stragglers if _matches(s, injection)]
    if not hits:
        return f"seed {seed}: {injection} not named (true cost {cost_ms:.3f} ms)"
    if abs(hits[0].cost_ms - cost_ms) > max(COST_TOLERANCE * cost_ms, FLOOR_MS, tolerance_ms):
        return f"seed {seed}: {injection} cost {hits[0].cost_ms:.4f} ms, true {cost_ms:.4f} ms"
    return None


@pytest.mark.timeout(3600 if EXPLORING else 180)
def test_injected_stragglers_are_named_with_their_cause_and_cost_in_99_percent_of_cases(
    tmp_path,
):
    specs = [random_case(seed) for seed in seeds("injected")]
    problems: list[str] = []
    for spec in specs:
        truth, found = _analyze(spec, tmp_path)
        for injection, cost_ms in zip(spec.injections, truth.costs_ms, strict=True):
            problems.append(_miss(spec.seed, injection, cost_ms, found, tolerance_ms=0.0))
    problems = [p for p in problems if p is not None]
    injected = sum(len(spec.injections) for spec in specs)
    print(f"{injected - len(problems)} of {injected} injected stragglers named right")
    print("\n".join(problems))
    assert len(problems) <= (1 - NAMED_SHARE) * injected, problems
    # Every cause on both backends, blocking or not, on one host and across hosts.
    drawn = {(i.cause, s.backend, s.blocking) for s in specs for i in s.injections}
    assert drawn == {(c, b, k) for c in CAUSES for b in ("nccl", "gloo") for k in (True, False)}
    assert {s.ranks <= s.ranks_per_host for s in specs} == {True, False}


@pytest.mark.parametrize("seed", [3, 17])
def test_a_control_with_the_injections_left_out_of_the_traces_is_not_named(tmp_path, seed):
    """The check can fail: the same runs without injections name none of them."""
    spec = random_case(seed)
    write_run(dataclasses.replace(spec, injections=()), tmp_path)
    found = find_stragglers(analyze_run(tmp_path, programs=True, jobs=1).programs)
    assert found.stragglers == [], found.stragglers
    for injection in spec.injections:
        assert not any(_matches(s, injection) for s in found.stragglers)


def long_case(seed: int, jitter: float) -> RunSpec:
    """A run of ``random_case``'s shape, long enough for the noise to be measured from it: 8 to
    12 steps of 3 collectives; no injections."""
    rng = np.random.default_rng([seed, 1])
    return dataclasses.replace(
        random_case(seed),
        steps=int(rng.integers(8, 13)),
        collectives_per_step=3,
        jitter=jitter,
        injections=(),
    )


@pytest.mark.timeout(3600 if EXPLORING else 120)
def test_a_clean_run_with_realistic_jitter_names_no_straggler(tmp_path):
    named = []
    for seed in seeds("clean"):
        jitter = float(np.random.default_rng([seed, 2]).uniform(*REALISTIC_JITTER))
        _, found = _analyze(long_case(seed, jitter), tmp_path)
        named += [f"seed {seed}, jitter {jitter:.2%}: {s}" for s in found.stragglers]
    assert named == [], "\n".join(named)


def deviation_bounds_ms(spec: RunSpec, cause: str) -> tuple[float, float]:
    """The least and the most standard deviation, in ms, of one op (``compute``; each op's time
    is drawn from 0.5 to 1.5 ``op_ms``, its jitter is relative) or of a transfer (``comm``)."""
    if cause == "comm":
        return spec.transfer_ms * spec.jitter, spec.transfer_ms * spec.jitter
    return 0.5 * spec.op_ms * spec.jitter, 1.5 * spec.op_ms * spec.jitter


def within_and_beyond_the_noise(seed: int) -> tuple[RunSpec, Injection, Injection]:
    """A long run of one-op segments jittering by ``COMPARABLE_JITTER`` with two injections, on
    two ranks in two steps: a longer op or transfer within the noise (``WITHIN_NOISE`` x its
    least deviation) and one far beyond it (``BEYOND_NOISE`` x its most)."""
    spec = dataclasses.replace(long_case(seed, COMPARABLE_JITTER), ops_per_segment=1)
    rng = np.random.default_rng([seed, 3])
    ranks, steps = rng.permutation(spec.ranks), rng.permutation(range(1, spec.steps + 1))
    injections = []
    for i, multiple in enumerate((WITHIN_NOISE, BEYOND_NOISE)):
        cause = str(rng.choice(["compute", "comm"]))
        least, most = deviation_bounds_ms(spec, cause)
        injections.append(
            Injection(
                rank=int(ranks[i]),
                step=int(steps[i]),
                position=int(rng.integers(spec.collectives_per_step)),
                cause=cause,
                delay_ms=multiple * (least if multiple == WITHIN_NOISE else most),
            )
        )
    within, beyond = injections
    return dataclasses.replace(spec, injections=(within, beyond)), within, beyond


@pytest.mark.timeout(3600 if EXPLORING else 120)
def test_a_delay_within_the_noise_is_not_named_and_one_far_beyond_it_is(tmp_path):
    problems = []
    for seed in seeds("within_noise"):
        spec, _, beyond = within_and_beyond_the_noise(seed)
        truth, found = _analyze(spec, tmp_path)
        others = [s for s in found.stragglers if not _matches(s, beyond)]
        if others:
            problems.append(f"seed {seed}: named besides {beyond}: {others}")
        # Its cost is known up to the jitter of this rank and of the ranks it is compared with.
        tolerance_ms = COST_JITTERS * deviation_bounds_ms(spec, beyond.cause)[1]
        problems.append(_miss(seed, beyond, truth.costs_ms[1], found, tolerance_ms))
    problems = [p for p in problems if p is not None]
    assert problems == [], "\n".join(problems)
