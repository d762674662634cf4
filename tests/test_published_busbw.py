"""The cost model against published nccl-tests bus bandwidths (cost/data/published_busbw.tsv)."""

import dataclasses
import json

import pytest

from overlapkit.cli import main
from overlapkit.cost import estimate, libraries, nccl_chunking, nvls
from overlapkit.cost.nvls import RACK_EXPONENT, TREE_WARP_FACTOR
from overlapkit.cost.published import (
    TOLERANCE,
    load_measurements,
    predict,
    render_checks,
    topology_for,
    validate,
)
from overlapkit.planner import Workload, plan
from overlapkit.topology import load_topology

CHECKS = validate()


def test_every_published_row_is_within_15_percent_or_its_notes_say_why():
    table = render_checks(CHECKS)
    print("\n" + table)
    outside = {c.measurement.id for c in CHECKS if abs(c.error) > TOLERANCE}
    explained = {c.measurement.id for c in CHECKS if c.explained_miss}
    assert outside <= explained, f"outside +-{TOLERANCE:.0%}: {outside - explained}\n{table}"
    assert explained <= outside, f"notes explain a miss the model no longer makes: {explained}"
    assert len(outside) <= 1  # the miss is the exception, not a way to pass


def test_the_large_message_rows_of_issue_15_still_pass():
    large = [c for c in CHECKS if c.measurement.nbytes >= 4 * 2**30]
    assert len(large) >= 30
    assert all(c.within_tolerance for c in large), [c.measurement.id for c in large]


RING_SWEEPS_FIT = ("a100-8-azure-", "gb200-4-azure-")
NVLS_SWEEPS_FIT = ("h200-8-azure-", "gb200-nvl72-72-")
MEDIUM_SWEEPS_FIT = RING_SWEEPS_FIT + NVLS_SWEEPS_FIT


def test_fit_rows_are_two_large_rows_and_four_sweeps_and_a_sweep_per_mechanism_is_held_out():
    fitted = {c.measurement.id: c for c in CHECKS if c.measurement.split == "fit"}
    sweeps = {i for i in fitted if i.startswith(MEDIUM_SWEEPS_FIT) and i != "gb200-nvl72-72-4g"}
    assert set(fitted) - sweeps == {"gb200-nvl72-72-4g", "dgx-h100x2-16-8g"}
    assert len(sweeps) == 13 + 13 + 13 + 3
    for row in ("gb200-nvl72-72-4g", "dgx-h100x2-16-8g"):  # their constants reproduce them
        assert abs(fitted[row].error) < 0.001, row
    held = [c for c in CHECKS if c.measurement.split == "held_out" and c.measurement.nbytes < 2**32]
    nvls = [c for c in held if c.measurement.id.startswith("h100-8-azure-")]
    nvls_tree = [c for c in held if c.measurement.id.startswith("gb200-nvl72x2-144-")]
    assert len(nvls) == 12 and len(nvls_tree) == 3
    assert {c.estimate.algorithm for c in nvls_tree} == {"switch"}


def _solve(set_constant, row, low, high):
    """The constant that makes ``row``'s prediction equal its measurement (bisection)."""
    topology = topology_for(row)
    rising = None
    for _ in range(50):
        middle = (low + high) / 2
        set_constant(middle)
        error = (
            estimate(
                row.collective, nbytes=row.nbytes, topology=topology, group_size=row.gpus
            ).busbw_GBps
            / row.busbw_GBps
            - 1
        )
        if rising is None:
            set_constant(high)
            top = estimate(
                row.collective, nbytes=row.nbytes, topology=topology, group_size=row.gpus
            )
            rising = top.busbw_GBps / row.busbw_GBps - 1 > error
        low, high = (low, middle) if (error > 0) == rising else (middle, high)
    return (low + high) / 2


def test_fitted_nvls_constants_follow_from_their_rows(monkeypatch):
    rows = {m.id: m for m in load_measurements()}
    rack = _solve(
        lambda x: monkeypatch.setattr(nvls, "RACK_EXPONENT", x), rows["gb200-nvl72-72-4g"], 0, 0.3
    )
    monkeypatch.undo()
    assert pytest.approx(rack, abs=1e-4) == RACK_EXPONENT
    warp = _solve(
        lambda x: monkeypatch.setattr(nvls, "TREE_WARP_FACTOR", x),
        rows["dgx-h100x2-16-8g"],
        0.5,
        1.2,
    )
    assert pytest.approx(warp, abs=1e-4) == TREE_WARP_FACTOR


def _worst_error(sweeps, monkeypatch=None):
    """The worst error over the rows of ``sweeps``; with ``monkeypatch``, ``RACK_EXPONENT``
    refitted to its 4 GiB NVL72 row first (NVLS constants move that row too)."""
    rows = [(m, topology_for(m)) for m in load_measurements() if m.id.startswith(sweeps)]
    if monkeypatch is not None:
        row = next(m for m, _ in rows if m.id == "gb200-nvl72-72-4g")
        _solve(lambda x: monkeypatch.setattr(nvls, "RACK_EXPONENT", x), row, 0, 0.3)
    worst = 0.0
    for m, topology in rows:
        predicted = estimate(
            m.collective,
            nbytes=m.nbytes,
            topology=topology,
            group_size=m.gpus,
            algorithm=m.algorithm,
        )
        worst = max(worst, abs(predicted.busbw_GBps / m.busbw_GBps - 1))
    return worst


@pytest.mark.parametrize(
    ("set_to", "values", "sweeps"),
    [
        (lambda mp, v: mp.setattr(libraries, "LL128_EFFICIENCY", v), (0.55, 0.65), RING_SWEEPS_FIT),
        (lambda mp, v: mp.setattr(nccl_chunking, "RING_FILL_STEPS", v), (0, 2), RING_SWEEPS_FIT),
        (
            lambda mp, v: mp.setitem(nccl_chunking.HALF_BYTES, "simple", v),
            (64 << 10, 96 << 10),
            RING_SWEEPS_FIT,
        ),
        (lambda mp, v: mp.setitem(nccl_chunking.HALF_BYTES, "ll", v), (512, 2048), RING_SWEEPS_FIT),
        (
            lambda mp, v: mp.setitem(nccl_chunking.HALF_BYTES, "nvls", v),
            (4 << 10, 8 << 10),
            NVLS_SWEEPS_FIT,
        ),
        (lambda mp, v: mp.setattr(nccl_chunking, "NVLS_FILL_LOOPS", v), (2, 4), NVLS_SWEEPS_FIT),
    ],
    ids=["ll128-efficiency", "ring-fill", "simple-half", "ll-half", "nvls-half", "nvls-fill"],
)
def test_each_fitted_pipeline_constant_is_a_minimax_optimum_of_its_sweeps(
    monkeypatch, set_to, values, sweeps
):
    # The grid search chose the constants that make the worst row of their sweeps smallest (to
    # 0.1 %, ties going to the smaller mean error); one grid step away in either direction, the
    # worst row is no better.
    refit = monkeypatch if sweeps is NVLS_SWEEPS_FIT else None
    best = _worst_error(sweeps, refit)
    for value in values:
        set_to(monkeypatch, value)
        assert _worst_error(sweeps, refit) >= best - 0.001, value


def test_every_row_quotes_a_public_source():
    for m in load_measurements():
        assert m.source.startswith("https://"), m.id
        assert m.notes and m.system, m.id


def test_the_seeds_nvls_and_network_errors_are_gone():
    # Issue 15: 8 x H100 NVLS +12-14 %, NVL72 +41 %, 2 x 8 H100 +31 %, 2 x 8 B200 -10 %.
    errors = {c.measurement.id: c.error for c in CHECKS}
    for row in ("h200-8-nvls-azure", "gb200-nvl72-72-8g", "hgx-b200x2-16-8g", "b200-8-nvls-1807"):
        assert abs(errors[row]) < 0.05, row


def test_overrides_describe_hardware_the_preset_lacks():
    h800 = next(m for m in load_measurements() if m.id == "h800-8-nvls-1374")
    assert topology_for(h800).domains[0].bandwidth_GBps == pytest.approx(8 * 25)
    nvl4 = next(m for m in load_measurements() if m.id == "gb200-nvl4x3-ring")
    topo = topology_for(nvl4)
    assert topo.world_size == 12 and len(topo.domains) == 3
    assert not topo.domains[0].in_network_reduction
    assert predict(nvl4).algorithm == "ring"


def test_overrides_that_do_not_fit_the_preset_are_named():
    h800 = next(m for m in load_measurements() if m.id == "h800-8-nvls-1374")
    with pytest.raises(ValueError, match="override 'scale_up.linkz' is not a preset key"):
        topology_for(dataclasses.replace(h800, overrides=(("scale_up.linkz", 8),)))
    with pytest.raises(ValueError, match="give the node count as nodes=N"):
        topology_for(dataclasses.replace(h800, topology="dgx-h100x2"))


def test_nvls_stops_winning_below_half_a_mebibyte_on_one_h100_node():
    topo = load_topology("dgx-h100")
    assert estimate("all_reduce", nbytes=64 * 2**10, topology=topo).algorithm != "switch"
    assert estimate("all_reduce", nbytes=4 * 2**20, topology=topo).algorithm == "switch"
    # Reduce-scatter and all-gather gain nothing from the switch (busbw ~370 either way).
    assert estimate("all_gather", nbytes=2**33, topology=topo).algorithm == "ring"


def test_nvls_tree_pays_off_on_two_h100_nodes_but_not_on_four():
    two = estimate("all_reduce", nbytes=2**33, topology=load_topology("dgx-h100x2"))
    four = estimate("all_reduce", nbytes=2**33, topology=load_topology("dgx-h100x4"))
    ring_two = estimate(
        "all_reduce", nbytes=2**33, topology=load_topology("dgx-h100x2"), algorithm="ring"
    )
    assert two.algorithm == "switch" and two.busbw_GBps > 1.15 * ring_two.busbw_GBps
    # Beyond 2 nodes the tree's NICs carry 2 x S: ring and NVLS-tree come within a few per cent
    # (nccl#1221 saw 320 GB/s on 4 nodes with NVLS on or off).
    # From 4 nodes on NVLS-tree's chunks are 64 KiB (nvls.cc), a few per cent slower still.
    times = {a: t for a, p, t in four.candidates if p == "simple"}
    assert times["switch"] == pytest.approx(times["ring"], rel=0.07)


def test_estimate_validate_prints_the_table_and_exits_zero(capsys):
    assert main(["estimate", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "https://github.com/coreweave/nccl-tests" in out
    inside = sum(c.within_tolerance for c in CHECKS)
    assert f"{inside}/{len(CHECKS)} within +-15%, {len(CHECKS) - inside} outside with the" in out
    assert " * " in out and " ! " not in out  # the miss is marked as explained
    assert main(["estimate", "--validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {
        "id",
        "published_busbw_GBps",
        "predicted_busbw_GBps",
        "error",
        "explained_miss",
        "source",
    } <= set(doc["checks"][0])


def test_estimate_without_a_size_names_what_is_missing(capsys):
    assert main(["estimate", "--collective", "all_reduce", "--topology", "dgx-h100"]) == 2
    assert "estimate needs --bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a topology, a bandwidth or --validate, as for plan
        main(["estimate", "--collective", "all_reduce", "--bytes", "1"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("\tfit\t", "\tmaybe\t"), "split 'maybe' must be one of"),
        (("\t8589934592\t", "\tlots\t"), r"row 'h200-8-nvls-azure': bytes"),
        (("\tscale_up.links=8\t", "\tlinks8\t"), "override 'links8' is not key=value"),
    ],
)
def test_a_malformed_measurements_file_names_the_row(tmp_path, edit, message):
    from overlapkit.cost.published import default_path

    text = default_path().read_text(encoding="utf-8").replace(*edit, 1)
    path = tmp_path / "bad.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_measurements(path)


def test_plan_prices_tensor_and_data_parallel_traffic_with_the_validated_figures():
    # dp over 2 H100 nodes at 8 GiB is the fit row's system; tp inside a node is NVLS.
    topo = load_topology("dgx-h100x2")
    workload = Workload(params=70e9)
    placement = plan(topo, tp=8, workload=workload)
    costs = {c.dim: c for c in placement.collectives()}
    tp = costs["tp"].estimate
    assert tp.algorithm == "switch"
    assert tp.time_s == pytest.approx(
        estimate("all_reduce", nbytes=costs["tp"].nbytes, topology=topo, group_size=8).time_s
    )
    whole = plan(topo, dp=16, workload=workload)
    dp = {c.dim: c for c in whole.collectives()}["dp"].estimate
    ring = estimate("all_reduce", nbytes=dp.nbytes, topology=topo, algorithm="ring")
    assert dp.algorithm == "switch" and dp.time_s < ring.time_s / 1.15
