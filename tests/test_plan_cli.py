"""``overlapkit plan`` and ``overlapkit estimate --group`` through the real command."""

import json

import pytest

from overlapkit.cli import main
from overlapkit.cost import estimate
from overlapkit.planner import Workload, plan
from overlapkit.topology import load_topology


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_json_has_the_design_keys_and_matches_the_library(capsys):
    code, out, _ = _run(
        ["plan", "--topology", "dgx-h100x4", "--tp", "8", "--pp", "2", "--params", "70e9",
         "--json"],
        capsys,
    )  # fmt: skip
    doc = json.loads(out)
    assert code == 0
    assert {"world_size", "dims", "mesh_dim_names", "mesh", "groups", "collectives"} <= doc.keys()
    assert doc["world_size"] == 32 and doc["dims"]["tp"] == 8 and doc["dims"]["dp"] == 2
    assert doc["mesh_dim_names"] == ["pp", "dp", "ep", "cp", "tp"]
    expected = plan(load_topology("dgx-h100x4"), tp=8, pp=2, workload=Workload(params=70e9))
    assert doc["mesh"] == expected.mesh
    assert doc["groups"]["pp"] == [list(g) for g in expected.groups("pp")]
    assert [(c["dim"], c["collective"]) for c in doc["collectives"]] == [
        ("tp", "all_reduce"),
        ("dp", "all_reduce"),
        ("pp", "send_recv"),
    ]
    assert doc["collectives"][1]["time_s"] == expected.collectives()[1].time_s


def test_plan_table_shows_where_groups_live_the_comm_and_a_rank_grid(capsys):
    code, out, _ = _run(["plan", "--topology", "dgx-h100x2", "--tp", "4", "--pp", "2"], capsys)
    assert code == 0
    assert "tp    4     4       inside one nvlink domain (one node)" in out
    assert "pp    2     8       across 2 domains, 1 rank(s) in each; rail-aligned" in out
    assert "predicted communication per step" in out and "total per step:" in out
    assert "rank grid (one row per node; cell = rank:pp.dp.tp coordinates)" in out
    assert "node 1   domain 1   8:1.0.0" in out


def test_no_rank_grid_picture_beyond_64_ranks(capsys):
    _, out, _ = _run(["plan", "--topology", "gb200-nvl72x2", "--tp", "8", "--ep", "9"], capsys)
    assert "rank grid" not in out
    assert "ep    9     16      inside one nvlink domain (9 nodes of one domain)" in out


def test_compare_shows_the_naive_arange_beside_the_plan(capsys):
    # tp x cp = 6 does not divide 8: the plan puts ep inside cp, arange keeps cp inside ep.
    argv = ["plan", "--topology", "dgx-h100x3", "--tp", "2", "--cp", "3", "--ep", "4", "--compare"]
    code, out, _ = _run([*argv, "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["mesh_dim_names"] == ["pp", "dp", "cp", "ep", "tp"]
    assert doc["naive"]["layout"] == "arange" and doc["naive"]["groups"]["ep"][0] == [0, 6, 12, 18]
    assert doc["naive"]["comm_s_per_step"] > doc["comm_s_per_step"]
    _, out, _ = _run(argv, capsys)
    assert "compare: planned layout vs naive arange (init_device_mesh)" in out
    assert "arange ep: straddles up to 3 domains unevenly" in out
    assert "naive arange layout:" in out  # its rank grid, 24 ranks
    _, out, _ = _run(["plan", "--topology", "dgx-h100x2", "--tp", "8", "--compare"], capsys)
    assert "(the two layouts are identical here)" in out


def test_refusal_exits_2_with_sizes_and_suggestions(capsys):
    code, out, err = _run(["plan", "--topology", "dgx-h100x3", "--tp", "3"], capsys)
    assert code == 2 and out == ""
    assert "cannot place tp=3 dp=8 on 'dgx-h100x3'" in err
    assert "Nearest valid layouts: tp=4 dp=6; tp=2 dp=12" in err
    code, out, _ = _run(["plan", "--topology", "dgx-h100x3", "--tp", "3", "--allow-split"], capsys)
    assert code == 0 and "split allowed: tp straddles scale-up domains" in out


def test_order_override_and_hsdp_from_the_command_line(capsys):
    code, out, _ = _run(
        ["plan", "--topology", "dgx-h100x2", "--tp", "2", "--dp-shard", "4", "--json"], capsys
    )
    assert json.loads(out)["mesh_dim_names"] == [
        "pp", "dp_replicate", "dp_shard", "ep", "cp", "tp"
    ]  # fmt: skip
    code, _, err = _run(
        ["plan", "--topology", "dgx-h100x2", "--tp", "8", "--order", "pp,ep,cp,tp,dp"], capsys
    )
    assert code == 2 and "Without order=, the planner places them as" in err


def test_forced_algorithm_applies_where_it_can_run(capsys):
    _, out, _ = _run(
        ["plan", "--topology", "dgx-h100x2", "--tp", "8", "--algorithm", "ring", "--json"], capsys
    )
    algorithms = {c["dim"]: c["algorithm"] for c in json.loads(out)["collectives"]}
    assert algorithms == {"tp": "ring", "dp": "ring"}


def test_estimate_group_names_a_placement_axis(capsys):
    code, out, _ = _run(
        ["estimate", "--collective", "all_reduce", "--bytes", "140e9", "--topology", "dgx-h100x4",
         "--group", "dp", "--tp", "8", "--json"],
        capsys,
    )  # fmt: skip
    doc = json.loads(out)
    topology = load_topology("dgx-h100x4")
    expected = estimate("all_reduce", nbytes=140e9, topology=topology, group=[0, 8, 16, 24])
    assert code == 0 and doc["group_size"] == 4 and doc["time_s"] == expected.time_s
    code, _, err = _run(
        ["estimate", "--collective", "all_reduce", "--bytes", "1", "--topology", "dgx-h100",
         "--group", "dp", "--group-size", "2"],
        capsys,
    )  # fmt: skip
    assert code == 2 and "either --group" in err
    code, _, err = _run(
        ["estimate", "--collective", "all_reduce", "--bytes", "1", "--topology", "dgx-h100",
         "--tp", "2"],
        capsys,
    )  # fmt: skip
    assert code == 2 and "make a placement for --group AXIS" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "0"], "tp must be >= 1, got 0"),
        (["--tp", "8", "--pp", "3"], "= 24 does not divide the 32 ranks"),
        (["--params", "lots"], "--params: cannot read 'lots' as a size"),
        (["--dtype", "int4"], "dtype 'int4' is not known"),
    ],
)
def test_plan_rejects_bad_input_naming_it(argv, message, capsys):
    code, _, err = _run(["plan", "--topology", "dgx-h100x4", *argv], capsys)
    assert code == 2 and message in err
