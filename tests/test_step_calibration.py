"""overlapkit.train.planning.host_calibration: the host terms ``overlapkit calibrate --host``
measures (and bench.planner_ranking with it), on 2 ranks.

What they measure is timing (checked side by side by the benchmark, not here); these tests
check that each runs on real process groups, that every rank gets the slowest rank's figures,
and that the topology file written from them loads back with those figures as its
accelerator section, which the planner then prices CPU ranks with.
"""

import pytest

from overlapkit.autoplan.settings import SearchSettings
from overlapkit.topology import parse_topology_yaml
from overlapkit.train.planning.host_calibration import HostEffort, host_calibration, host_workload
from tests.multiproc import run_on_ranks

OVERRIDES = [
    "model.config.n_layer=2",
    "model.config.n_head=2",
    "model.config.n_embd=32",
    "model.config.block_size=16",
    "train.batch_size=2",
]
EFFORT = HostEffort(steps=3, probes=3, probe_work=1, overlap_trials=2, optimizer_steps=3)
LINK = {"budget_s": 0.02, "progress": False, "quantile": 0.5, "fit_min_bytes": 0}


def _calibrate(rank: int, world_size: int, workload) -> tuple[str, dict]:
    # gloo on loopback takes about as long for any message up to ~1 MiB (cost.calibrate's
    # fit): sizes beyond it, or the fit finds no bandwidth.
    return host_calibration(workload, [1 << 20, 1 << 23], LINK, EFFORT)


@pytest.mark.slow
def test_host_calibration_gives_every_rank_the_slowest_ranks_figures_and_a_loadable_topology():
    workload = host_workload(OVERRIDES)
    assert (workload.batch_size, workload.seq_len) == (2, 16)
    per_rank = run_on_ranks(_calibrate, 2, workload)
    assert per_rank[0][1] == per_rank[1][1]  # the slowest rank's medians, on every rank
    text, terms = per_rank[0]
    assert terms["flops_per_s"] > 0 and terms["tp_layer_dispatch_s"] >= 0
    assert terms["collective_overhead_s"] > 0
    assert terms["optimizer_tensor_s"] > 0 and terms["optimizer_dtensor_s"] > 0
    assert terms["optimizer_param_s"] >= 0
    assert 0 <= terms["overlap_efficiency"] <= 1
    topology = parse_topology_yaml(text, source="host.yaml")
    accelerator, host = topology.accelerator, topology.accelerator.host
    assert topology.world_size == 2 and accelerator.name == "measured-host"
    assert accelerator.peak_bf16_tflops == pytest.approx(terms["flops_per_s"] / 1e12, rel=1e-5)
    for key in ("collective_overhead_s", "optimizer_tensor_s", "optimizer_dtensor_s"):
        assert getattr(host, key) == pytest.approx(terms[key], rel=1e-5), key
    # The planner takes the measured rate as achieved and the host's costs as its step terms.
    options = SearchSettings(framework="overlapkit-train").step_options(topology, seq_len=16)
    assert options.achievable == 1.0
    assert options.collective_overhead_s == host.collective_overhead_s
    assert options.overlap_efficiency == host.overlap_efficiency


def test_host_calibration_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match="measures a transformer"):
        host_workload(["model=mlp"])
