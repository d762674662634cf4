"""The dim labels the issuers of collectives write into a trace, read back."""

from __future__ import annotations

import pytest
import torch

from overlapkit.group.dim_labels import (
    COMM_DIMS,
    LABEL_PREFIX,
    comm_dim,
    dim_of_group_desc,
    dim_of_label,
)
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.report import format_report
from tests.multiproc import run_on_ranks


def test_every_dim_round_trips_and_others_are_no_label():
    for dim in COMM_DIMS:
        assert dim_of_label(LABEL_PREFIX + dim) == dim
    assert dim_of_label("aten::mm") is None
    assert dim_of_label(LABEL_PREFIX + "zz") is None


def test_an_unknown_dim_is_refused_in_one_line():
    with (
        pytest.raises(ValueError, match=r"comm_dim: dim must be one of tp, cp, ep, pp, dp"),
        comm_dim("mp"),
    ):
        pass


@pytest.mark.parametrize(
    ("desc", "dim"),
    [
        ("mesh_tp", "tp"),
        ("mesh_ep", "ep"),
        ("mesh_dp_shard", "dp"),
        ("mesh_dp_cp", "dp"),
        ("mesh_pp", "pp"),
        ("default_pg", None),
        (None, None),
        ("mesh_weird", None),
    ],
)
def test_mesh_group_descriptions_name_their_dim(desc, dim):
    assert dim_of_group_desc(desc) == dim


CHUNKS = 2


def _known_traffic(rank: int, world_size: int, logdir: str) -> None:
    """Three groups described as mesh axes but gloo (the trace says none of it), each step: a
    tp all-gather (sync), a dp all-reduce and an ep all-to-all in flight under a matmul, a
    chunked expert dispatch forward and backward, and an unlabelled all-reduce on the world."""
    import torch.distributed as dist

    import overlapkit as ok
    from overlapkit.inlayer.chunked_ep import dispatch_combine

    groups = {d: dist.new_group([0, 1], group_desc=f"mesh_{d}") for d in ("tp", "dp", "ep")}
    weights = torch.randn(2, 8, 8, requires_grad=True)
    with ok.profile(logdir, wait=0, warmup=1, active=2, record_shapes=True) as prof:
        for _ in range(3):
            with comm_dim("tp"):
                gathered = torch.empty(2000)
                dist.all_gather_into_tensor(gathered, torch.ones(1000), group=groups["tp"])
            with comm_dim("dp"):
                reduced = dist.all_reduce(torch.ones(3000), group=groups["dp"], async_op=True)
            with comm_dim("ep"):
                out = torch.empty(400)
                sent = dist.all_to_all_single(
                    out, torch.ones(400), group=groups["ep"], async_op=True
                )
            torch.randn(300, 300) @ torch.randn(300, 300)
            reduced.wait()
            sent.wait()
            rows = torch.randn(12, 8, requires_grad=True)
            experts = lambda x, counts: torch.cat(  # noqa: E731
                [r @ weights[e] for e, r in enumerate(torch.split(x, list(counts)))]
            )
            expert_of = torch.arange(12) % 4
            y = dispatch_combine(rows, expert_of, 4, experts, group=groups["ep"], chunks=CHUNKS)
            y.sum().backward()
            dist.all_reduce(torch.ones(10))
            prof.step()


def test_report_dims_split_a_gloo_run_by_the_labels_of_its_issuers(tmp_path):
    run_on_ranks(_known_traffic, 2, str(tmp_path), total_timeout_s=120)
    report = analyze_run(tmp_path)
    assert len(report.steps) == 4  # 2 ranks x 2 active steps
    for row in report.steps:
        counts = {dim: s.count for dim, s in row.dims.items()}
        # ep: the explicit all-to-all, the dispatch's routing counts, then dispatch and combine
        # per chunk, forward and backward.
        assert counts == {"tp": 1, "dp": 1, "ep": 1 + 1 + 4 * CHUNKS, "other": 1}, row.dims
        assert row.dims["dp"].nbytes == 3000 * 4
        assert sum(s.count for s in row.kinds.values()) == sum(counts.values())
        assert sum(s.time_ms for s in row.dims.values()) >= row.comm_ms - 1e-6
        # Nothing hid the synchronous all-gather.
        assert row.dims["tp"].exposed_ms == pytest.approx(row.dims["tp"].time_ms)
        assert set(row.to_dict()["dims"]["ep"]) == {"count", "bytes", "time_ms", "exposed_ms"}
    text = format_report(report)
    assert text.count("; by dim: tp 1x ") == len(report.steps), text


def test_nccl_collectives_take_their_dim_from_the_mesh_group_else_a_label_else_other():
    from types import SimpleNamespace

    from overlapkit.profiling.comm_dims import comm_dims
    from overlapkit.profiling.rank_trace import CommOp

    groups = [
        {"pg_name": "1", "ranks": [0, 1], "pg_desc": "mesh_tp"},
        {"pg_name": "2", "ranks": [0, 2], "pg_desc": "mesh_dp_shard"},
        {"pg_name": "3", "ranks": [0, 3], "pg_desc": "default_pg"},
    ]
    comm = [
        CommOp(10.0, 20.0, 5.0, "all_gather", 8, group="1"),
        CommOp(30.0, 40.0, 25.0, "reduce_scatter", 8, group="2"),
        CommOp(50.0, 60.0, 45.0, "all_to_all", 8, group="3"),  # launched inside an ep label
        CommOp(70.0, 80.0, 65.0, "all_reduce", 8, group="3"),
    ]
    trace = SimpleNamespace(
        device="gpu", groups=groups, comm=comm, labels=[(40.0, 48.0, 7, "ep")], enqueues=[]
    )
    assert comm_dims(trace) == ["tp", "dp", "ep", "other"]
