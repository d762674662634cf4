"""The data-parallel mesh of ``ok.fsdp``: 1-D (FSDP) or 2-D (HSDP), checked against the world.

FSDP2's convention, which ``ok.fsdp`` keeps: on a 2-D mesh, **axis 0 replicates and axis 1
shards** (placements ``(Replicate(), Shard(0))``). Gradients are reduce-scattered over axis 1 and
all-reduced over axis 0, so axis 1 should be the fast (intra-node) one. A planner mesh with named
axes is passed as ``mesh["dp_replicate", "dp_shard"]``; an axis whose name says "shard" on
axis 0 (or "replicate" on axis 1) is rejected rather than silently sharding over the wrong ranks.

A model built on the meta device (FSDP2's deferred initialisation: build under
``torch.device("meta")``, shard, then ``to_empty`` and initialise) has no device of its own yet:
its mesh is the one given, or one on the device the default process group communicates on
(``backend_device_type``: CUDA for NCCL, the CPU for gloo), as ``fully_shard``'s default mesh
is. The mesh's device type, not the parameters', then says where the model lives.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlapkit.group.process_group import backend_device_type

META = "meta"
"""The device type of a model built for deferred initialisation (``torch.device("meta")``)."""


def _check_axis_names(names: tuple[str, ...] | None) -> None:
    if not names or len(names) != 2:
        return
    replicate_name, shard_name = names
    if "shard" in replicate_name.lower() or "replicate" in shard_name.lower():
        raise ValueError(
            f"ok.fsdp: mesh axes are named {names}, but a 2-D mesh must be (replicate, shard): "
            "axis 0 replicates and axis 1 shards (FSDP2's HSDP convention); build the mesh "
            "with the replicate axis first"
        )


def _root_of(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself when it was not sliced).

    ``DeviceMesh._get_root_mesh()`` in torch 2.13; torch 2.9 keeps the mapping in the module's
    ``_mesh_resources`` instead. Without either, a slice would be checked as if it were the root.
    """
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    from torch.distributed import device_mesh

    return device_mesh._mesh_resources.get_root_mesh(mesh)


def resolve_mesh(mesh: DeviceMesh | None, device_type: str) -> DeviceMesh:
    """Return ``mesh`` after checking it, or a 1-D mesh over the world when it is None.

    Args:
        mesh (DeviceMesh | None): 1-D (shard over all its ranks) or 2-D (replicate, shard).
            It must span the world, or be a slice (``mesh["dp"]``) of a mesh that does.
        device_type (str): the model's parameters' device type (``"cpu"``, ``"cuda"``), which
            the mesh must match, or ``META`` (any mesh; the default on the process group's
            device).

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: wrong number of axes, axis names in the wrong order, a mesh whose size does
            not match the world, a mesh that does not contain this rank, or a mesh on another
            device type than the model's parameters.
    """
    world = dist.get_world_size()
    if mesh is None:
        default = backend_device_type() if device_type == META else device_type
        return init_device_mesh(default, (world,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"ok.fsdp: mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"ok.fsdp: mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D "
            f"with shape {tuple(mesh.shape)}; slice the data-parallel axes out first"
        )
    if device_type != META and mesh.device_type != device_type:
        raise ValueError(
            f"ok.fsdp: mesh device type {mesh.device_type!r} differs from the model's "
            f"parameters' device type {device_type!r}"
        )
    _check_axis_names(mesh.mesh_dim_names)
    root = _root_of(mesh)
    if root.size() != world:
        raise ValueError(
            f"ok.fsdp: mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}) but the world "
            f"has {world}; pass a mesh over all {world} ranks, or a slice of one"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"ok.fsdp: rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()}")
    return mesh
