"""The step-time and memory model against published training runs (data/published_runs.tsv).

The free search of every row is ``overlapkit plan --auto --validate``'s (tens of seconds at
thousands of GPUs); here the published layouts are evaluated, which takes about a second.
"""

import pytest

from overlapkit.autoplan.compute import LAYER_OVER_MATMUL
from overlapkit.autoplan.published_runs import (
    TOLERANCE,
    check_run,
    fit_layer_over_matmul,
    published_runs,
)

RUNS = published_runs()


def test_published_runs_name_their_source_and_quote_it():
    assert len(RUNS) >= 20
    for run in RUNS:
        assert run.source and run.quote and run.published > 0, run.name
        assert run.expected == "within" or run.expected.startswith("miss: "), run.name


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_published_layout_fits_and_its_throughput_is_predicted(run):
    check = check_run(run, free_search=False)
    assert check.predicted.fits, (run.name, check.predicted.memory.to_dict())
    if run.explained_miss:
        # The evidence is in the row; the error must stay what it explains (same sign).
        assert abs(check.error) > TOLERANCE * 0.5, (run.name, check.error)
    else:
        assert abs(check.error) <= TOLERANCE, (run.name, f"{check.error:+.1%}")


def test_most_published_runs_are_within_tolerance():
    inside = sum(not r.explained_miss for r in RUNS)
    assert inside >= 0.7 * len(RUNS)


@pytest.mark.slow
def test_layer_factor_is_the_least_squares_fit_to_the_published_runs():
    # A change to the cost or step-time model moves the fit: refit, then recheck every row.
    assert fit_layer_over_matmul(RUNS) == pytest.approx(LAYER_OVER_MATMUL, abs=0.005)
