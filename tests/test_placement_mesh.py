"""Placement.device_mesh(): a torch DeviceMesh over the planned grid, at scale and on real gloo.

Scale without processes: PyTorch's fake process group (``FakeStore`` + the ``"fake"`` backend)
gives one process any rank of any world size, so meshes of 64 to 1,152 ranks are built and
sliced here exactly as every rank of a real job would.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from overlapkit.fsdp.mesh import resolve_mesh
from overlapkit.planner import plan
from overlapkit.topology import load_topology, merge_views
from tests.multiproc import run_on_ranks


@contextlib.contextmanager
def fake_world(rank, world_size):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_mesh_matches_placement(placement, rank):
    mesh = placement.device_mesh("cpu")
    assert mesh.mesh_dim_names == placement.mesh_dim_names
    assert mesh.mesh.tolist() == placement.mesh
    for axis in placement.mesh_dim_names:
        (mine,) = [g for g in placement.groups(axis) if rank in g]
        assert mesh[axis].mesh.tolist() == list(mine), axis
        assert dist.get_process_group_ranks(mesh.get_group(axis)) == sorted(mine), axis
    return mesh


@pytest.mark.parametrize("rank", [0, 613, 1151])
def test_nvl72_mesh_of_1152_ranks_matches_the_planned_groups(rank):
    placement = plan(load_topology("gb200-nvl72x16"), tp=4, ep=18, pp=2)
    with fake_world(rank, 1152):
        mesh = _check_mesh_matches_placement(placement, rank)
        assert mesh.shape == (2, 8, 18, 1, 4)
        ep = mesh["ep"].mesh.tolist()
        assert len({rank // 72 for rank in ep}) == 1  # one NVL72 rack
        assert placement.device_mesh("cpu") is mesh  # built once


@pytest.mark.parametrize("rank", [0, 37])
def test_hsdp_mesh_of_64_ranks_slices_for_ok_fsdp(rank):
    placement = plan(load_topology("dgx-h100x8"), tp=2, pp=2, dp_shard=4)
    with fake_world(rank, 64):
        mesh = _check_mesh_matches_placement(placement, rank)
        dp = mesh["dp_replicate", "dp_shard"]
        assert resolve_mesh(dp, "cpu") is dp
        assert sorted(dp.mesh.flatten().tolist()) == sorted(
            next(g for g in placement.groups("dp") if rank in g)
        )


def test_interleaved_ranks_get_a_mesh_that_is_not_arange():
    views = [
        {"rank": r, "hostname": "h", "group_rank": r % 2, "local_rank": r // 2, "gpu": None,
         "nics": []}
        for r in range(8)
    ]  # fmt: skip
    placement = plan(merge_views(views), tp=4)
    with fake_world(0, 8):
        mesh = placement.device_mesh("cpu")
        assert mesh["tp"].mesh.tolist() == [0, 2, 4, 6]
        assert mesh.mesh.flatten().tolist() != list(range(8))


def test_device_mesh_needs_a_process_group_of_the_placements_size():
    placement = plan(load_topology("dgx-h100x2"), tp=8)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        placement.device_mesh("cpu")
    with (
        fake_world(0, 8),
        pytest.raises(ValueError, match="process group has 8 ranks but the placement"),
    ):
        placement.device_mesh("cpu")


@contextlib.contextmanager
def one_rank_gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mesh_over_gloo_is_a_cpu_mesh_even_where_cuda_is_available(monkeypatch):
    placement = plan(merge_views([_single_view()]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with one_rank_gloo():
        mesh = placement.device_mesh()
        assert mesh.device_type == "cpu"
        total = torch.ones(1)
        dist.all_reduce(total, group=mesh.get_group("dp"))
        assert total.item() == 1.0


def test_a_device_type_the_groups_backend_is_not_for_is_refused_naming_both():
    placement = plan(merge_views([_single_view()]))
    with (
        one_rank_gloo(),
        pytest.raises(
            ValueError,
            match=r"device_type='cuda' does not match the process group's backend "
            r"\(cpu:gloo,cuda:gloo\), which is for cpu tensors: pass device_type='cpu'",
        ),
    ):
        placement.device_mesh("cuda")


def _single_view():
    return {"rank": 0, "hostname": "h", "group_rank": 0, "local_rank": 0, "gpu": None, "nics": []}


def _gloo_body(rank, world_size):
    from overlapkit.planner import plan as plan_

    topology = load_topology("cpu-gloox2")
    out = {}
    for name, kwargs in {
        "planned": {},
        "wrong": {"order": ("pp", "ep", "cp", "tp", "dp"), "allow_split": True},
    }.items():
        placement = plan_(topology, tp=2, **kwargs)
        mesh = placement.device_mesh("cpu")
        sums = {}
        for axis in ("tp", "dp"):
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value, group=mesh.get_group(axis))
            sums[axis] = value.item()
        out[name] = (sums, {a: [list(g) for g in placement.groups(a)] for a in ("tp", "dp")})
    return out


@pytest.mark.slow
def test_meshes_of_both_layouts_reduce_over_their_planned_groups_on_gloo():
    results = run_on_ranks(_gloo_body, 4)
    for rank, result in enumerate(results):
        for name, (sums, groups) in result.items():
            for axis in ("tp", "dp"):
                (group,) = [g for g in groups[axis] if rank in g]
                assert sums[axis] == sum(r + 1 for r in group), (name, axis)
    assert results[0]["planned"][1] == {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    assert results[0]["wrong"][1] == {"tp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]}
