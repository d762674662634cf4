"""Calibration: the fit on exact synthetic data, the written topology, a real tiny run."""

import math

import pytest

from overlapkit.cost import estimate
from overlapkit.cost.calibrate import (
    Measurement,
    TierFit,
    calibrate,
    calibrated_yaml,
    fit_ring_all_reduce,
    sample_quantile,
    sizes_between,
)
from overlapkit.topology import merge_views, parse_topology_yaml


def _ring_time(nbytes, n, latency_us, bandwidth_GBps):
    return 2 * (n - 1) * latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / (bandwidth_GBps * 1e9)


def _measurements(n, latency_us, bandwidth_GBps, sizes=(4096, 65536, 2**20, 2**24, 2**28)):
    return [
        Measurement(
            nbytes=s,
            time_s=_ring_time(s, n, latency_us, bandwidth_GBps),
            group_size=n,
            iterations=5,
        )
        for s in sizes
    ]


def test_sizes_double_from_min_to_max():
    assert sizes_between(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
    assert len(sizes_between(4 * 2**10, 256 * 2**20)) == 17
    with pytest.raises(ValueError, match="min_bytes <= max_bytes"):
        sizes_between(1024, 512)


@pytest.mark.parametrize(("n", "latency_us", "bandwidth"), [(2, 25.0, 1.5), (8, 3.0, 300.0)])
def test_fit_recovers_latency_and_bandwidth_of_exact_ring_data(n, latency_us, bandwidth):
    fitted_latency, fitted_bandwidth = fit_ring_all_reduce(_measurements(n, latency_us, bandwidth))
    assert fitted_latency == pytest.approx(latency_us, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_fit_weighs_sizes_relatively_so_small_sizes_keep_their_latency():
    data = _measurements(2, 50.0, 2.0)
    data[-1] = Measurement(data[-1].nbytes, data[-1].time_s * 1.3, 2, 5)  # one slow big size
    latency, _ = fit_ring_all_reduce(data)
    assert latency == pytest.approx(50.0, rel=0.1)


def test_fit_with_a_negative_intercept_refits_zero_latency():
    data = [Measurement(s, s / 1e9 - 1e-7, 2, 5) for s in (2**20, 2**22, 2**24)]
    latency, bandwidth = fit_ring_all_reduce(data)
    assert latency == 0.0 and bandwidth == pytest.approx(1.0, rel=0.01)


def test_fit_needs_two_sizes_that_grow():
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_ring_all_reduce(_measurements(2, 1.0, 1.0, sizes=(4096,)))
    shrinking = [Measurement(4096, 2e-3, 2, 5), Measurement(2**20, 1e-3, 2, 5)]
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_ring_all_reduce(shrinking)


def test_calibrated_topology_predicts_what_the_fit_predicts():
    views = [
        {
            "rank": r,
            "hostname": "h",
            "group_rank": None,
            "local_rank": r,
            "local_world_size": 2,
            "gpu": None,
            "nics": [],
        }
        for r in range(2)
    ]
    data = _measurements(2, 40.0, 0.8)
    fit = TierFit("scale_up", (0, 1), *fit_ring_all_reduce(data), tuple(data))
    text = calibrated_yaml(merge_views(views), [fit], backend="gloo")
    assert text.startswith("# Measured by `overlapkit calibrate`")
    topo = parse_topology_yaml(text, source="calibrated.yaml")
    assert str(topo.library) == "gloo" and topo.world_size == 2
    for nbytes in (4096, 2**20, 2**28):
        est = estimate("all_reduce", nbytes=nbytes, topology=topo)
        assert est.time_s == pytest.approx(fit.predict_s(nbytes), rel=1e-5)
        assert est.time_s == pytest.approx(_ring_time(nbytes, 2, 40.0, 0.8), rel=1e-5)


def test_sample_quantile_interpolates_and_half_is_the_median():
    samples = [4.0, 1.0, 3.0, 2.0]
    assert sample_quantile(samples, 0.5) == pytest.approx(2.5)
    assert sample_quantile(samples, 0.25) == pytest.approx(1.75)
    assert sample_quantile([7.0], 0.25) == 7.0


@pytest.mark.parametrize("quantile", [0.0, 1.0, -0.5, 2.0])
def test_sample_quantile_outside_zero_one_names_the_value(quantile):
    with pytest.raises(ValueError, match=f"quantile must be in \\(0, 1\\), got {quantile}"):
        sample_quantile([1.0, 2.0], quantile)


@pytest.mark.parametrize("budget_s", [math.inf, math.nan, 10**400, 0])
def test_a_budget_that_is_not_a_finite_positive_number_is_refused_before_spawning(budget_s):
    with pytest.raises(ValueError, match="--budget-s must be a finite number of seconds > 0"):
        calibrate(budget_s=budget_s, output=None)


def test_fit_from_min_bytes_ignores_a_small_message_regime():
    # Large sizes follow the ring exactly; small ones are all one flat 1 ms (a different regime).
    large = _measurements(2, 30.0, 0.9, sizes=(2**20, 2**22, 2**24, 2**26))
    small = [Measurement(s, 1e-3, 2, 5) for s in (4096, 65536, 2**19)]
    latency, bandwidth = fit_ring_all_reduce(small + large, min_bytes=2**20)
    assert latency == pytest.approx(30.0, rel=1e-6)
    assert bandwidth == pytest.approx(0.9, rel=1e-6)
    whole_latency, _ = fit_ring_all_reduce(small + large)
    assert whole_latency > 100.0  # the flat small sizes pull one line's latency far off
    with pytest.raises(ValueError, match="two or more sizes >= 67108864 bytes, got 1"):
        fit_ring_all_reduce(small + large, min_bytes=2**26)
