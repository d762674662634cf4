"""The dim labels the issuers of collectives write into a trace, read back."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from overlapkit.group.dim_labels import (
    COMM_DIMS,
    LABEL_PREFIX,
    comm_dim,
    dim_of_group_desc,
    dim_of_label,
)


def test_comm_dim_writes_a_range_the_report_reads_back():
    with profile(activities=[ProfilerActivity.CPU]) as prof, comm_dim("ep"):
        torch.ones(4).sum()
    names = [e.name for e in prof.events()]
    labels = [n for n in names if n.startswith(LABEL_PREFIX)]
    assert labels == ["overlapkit.dim:ep"]
    assert dim_of_label(labels[0]) == "ep"


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
