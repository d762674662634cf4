"""The run's mesh: the ``parallel.plan`` sizes checked, placed by ``ok.plan``, turned into groups.

The ``parallel`` group's ``plan`` section holds ``ok.plan``'s keyword arguments (``tp``, ``ep``,
``cp``, ``pp``, ``dp``, ``dp_shard``, ``order``) and the pipeline's ``schedule`` and
``virtual_stages``; the rest of the group is the wrapper's factory. Every worker plans on the run's
topology and builds ``placement.device_mesh()``; the wrappers take their sub-meshes and groups
from it (``Layout``):

========================  =====================================================================
``dp_group``              ``ok.ddp`` / ``ok.GradBucketer``: gradients averaged over ``dp``
                          (``dp x cp`` flattened under context parallelism)
``dp_mesh``               ``ok.fsdp``: 1-D ``dp`` (``dp x cp``), or 2-D ``(dp_replicate,
                          dp_shard)`` for HSDP
``tp_mesh``               ``parallelize_module`` (tensor parallel inside the domain)
``cp_mesh``               context parallel: each sequence split over its ranks
``ep_mesh``               MoE layers: experts sharded, tokens dispatched with all-to-all
``dense_group``           parameters outside the experts: averaged over ``dp x ep``
``pp_mesh``               ``pipeline_parallel``: the stages' send/recv and loss broadcast
========================  =====================================================================

Ranks of one ``tp`` or ``cp`` group read the same batches, and so do the stages of one ``pp``
group; every other axis is data parallel for the dense parameters, so ``data_shard`` numbers the
batch shards over all axes but those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlapkit.group.process_group import inherit_timeout
from overlapkit.planner import Placement
from overlapkit.planner import plan as place
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

PLAN_KEY = "plan"
"""The key of the ``parallel`` group that holds ``ok.plan``'s arguments."""


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """The ``parallel.plan`` section: parallel sizes for ``ok.plan`` on the run's topology."""

    tp: int = 1
    """Tensor-parallel size (attention and MLP sharded with ``parallelize_module``)."""
    ep: int = 1
    """Expert-parallel size (MoE experts sharded, tokens dispatched with all-to-all)."""
    cp: int = 1
    """Context-parallel size (each sequence split over cp ranks, ``overlapkit.train.
    context_parallel``); ``2 x cp`` must divide ``data.seq_len``."""
    pp: int = 1
    """Pipeline-parallel size: the model's blocks split into stages (``pipeline_parallel``)."""
    schedule: str = "1F1B"
    """The ``torch.distributed.pipelining`` schedule with ``pp > 1`` (``pipeline_stages``)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (interleaved schedules); 1: one stage per rank."""
    dp: int = -1
    """Data-parallel size; -1 means whatever is left of the world."""
    dp_shard: int | None = None
    """HSDP: split dp into ``dp_replicate x dp_shard`` (``ok.fsdp`` shards over dp_shard)."""
    order: list[str] | None = None
    """Mesh axes outermost first, overriding the planner's traffic order (``ok.plan(order=)``)."""

    def __post_init__(self) -> None:
        check_int("parallel.plan.tp", self.tp, 1)
        check_int("parallel.plan.ep", self.ep, 1)
        check_int("parallel.plan.cp", self.cp, 1)
        check_int("parallel.plan.pp", self.pp, 1)
        check_int("parallel.plan.virtual_stages", self.virtual_stages, 1)
        if self.dp != -1:
            check_int("parallel.plan.dp", self.dp, 1)
        if self.dp_shard is not None:
            check_int("parallel.plan.dp_shard", self.dp_shard, 1)
        if self.order is not None:
            self.order = [str(axis) for axis in self.order]

    @property
    def trivial(self) -> bool:
        """Plain data parallelism over the world (what a run without a topology can do)."""
        sizes = (self.tp, self.ep, self.cp, self.pp)
        return all(n == 1 for n in sizes) and self.dp_shard is None

    def plan_kwargs(self) -> dict[str, Any]:
        return dict(
            tp=self.tp,
            ep=self.ep,
            cp=self.cp,
            pp=self.pp,
            dp=self.dp,
            dp_shard=self.dp_shard,
            order=self.order,
        )


def split_parallel(parallel: Mapping[str, Any]) -> tuple[PlanConfig, dict[str, Any]]:
    """The ``parallel`` group as (its ``plan`` section, the wrapper factory's config).

    Raises:
        ValueError / TypeError: an unknown key or a bad value in ``parallel.plan``.
    """
    factory = {k: v for k, v in parallel.items() if k != PLAN_KEY}
    sizes = dict(parallel.get(PLAN_KEY) or {})
    unknown = sorted(set(sizes) - set(PlanConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"parallel.plan.{unknown[0]} is not a planner size the training loop uses; valid: "
            f"{', '.join(PlanConfig.__dataclass_fields__)}"
        )
    return PlanConfig(**sizes), factory


_TARGETS = {
    "tp": ("overlapkit.GradBucketer",),
    "ep": ("overlapkit.GradBucketer",),
    "dp_shard": ("overlapkit.fsdp",),
}
_WHY = {
    "tp": "it reduces the tensor-parallel (DTensor) shards over dp",
    "ep": "expert and dense parameters are reduced over different groups",
    "dp_shard": "HSDP is ok.fsdp on a (dp_replicate, dp_shard) mesh",
}
SHARED_BATCH_AXES = ("tp", "cp", "pp")
"""Mesh axes whose ranks read the same batches (each computes its part of them; a pipeline's
first stage reads the inputs, its last the targets)."""


def check_plan(plan: PlanConfig, *, world_size: int, model_config: Any, target: str | None) -> None:
    """Refuse sizes that cannot work, before any worker starts; messages name the config keys.

    Args:
        plan (PlanConfig): the ``parallel.plan`` sizes.
        world_size (int): ``launcher.nnodes x launcher.nproc_per_node``.
        model_config: the model's config (``GPTConfig``, ``MoEConfig``, ``MLPConfig``).
        target (str | None): ``parallel._target_``, the wrapper factory.

    Raises:
        ValueError: sizes that do not multiply to (or divide) the world size, ``tp`` not
            dividing ``n_head``, ``ep`` not dividing ``n_expert``, a model without heads or
            experts for tp, ep or cp, a wrapper that cannot reduce such a layout, tp with ep,
            cp with ep or with dp_shard.
    """
    axes = {"tp": plan.tp, "ep": plan.ep}
    axes |= {name: n for name, n in (("cp", plan.cp), ("pp", plan.pp)) if n > 1}
    fixed = math.prod(axes.values())
    formula = (
        " x ".join(f"parallel.plan.{a}" for a in axes)
        + " = "
        + " x ".join(str(n) for n in axes.values())
    )
    where = "launcher.nnodes x launcher.nproc_per_node"
    if plan.dp == -1 and world_size % fixed:
        raise ValueError(
            f"{formula} = {fixed} does not divide the world size {world_size} ({where})"
        )
    if plan.dp != -1 and fixed * plan.dp != world_size:
        raise ValueError(
            f"{formula} x parallel.plan.dp ({plan.dp}) = {fixed * plan.dp}, but the world size "
            f"is {world_size} ({where}); use parallel.plan.dp=-1 for whatever is left"
        )
    dp = plan.dp if plan.dp != -1 else world_size // fixed
    if plan.dp_shard is not None and dp % plan.dp_shard:
        raise ValueError(
            f"parallel.plan.dp_shard ({plan.dp_shard}) must divide the data-parallel size {dp}"
        )
    if plan.tp > 1:
        n_head = getattr(model_config, "n_head", None)
        if n_head is None:
            raise ValueError(
                f"parallel.plan.tp={plan.tp} needs a transformer (model=gpt_tiny or moe_tiny); "
                f"{type(model_config).__name__} has no attention heads"
            )
        if n_head % plan.tp:
            raise ValueError(
                f"parallel.plan.tp ({plan.tp}) must divide model.config.n_head ({n_head})"
            )
    if plan.ep > 1:
        n_expert = getattr(model_config, "n_expert", None)
        if n_expert is None:
            raise ValueError(
                f"parallel.plan.ep={plan.ep} needs a mixture-of-experts model (model=moe_tiny); "
                f"{type(model_config).__name__} has no experts"
            )
        if n_expert % plan.ep:
            raise ValueError(
                f"parallel.plan.ep ({plan.ep}) must divide model.config.n_expert ({n_expert})"
            )
    if plan.tp > 1 and plan.ep > 1:
        raise ValueError(
            f"parallel.plan.tp ({plan.tp}) with parallel.plan.ep ({plan.ep}): tensor-parallel "
            "experts are not supported by the training loop; use one of them"
        )
    if plan.cp > 1:
        _check_context_parallel(plan, model_config)
    for key, targets in _TARGETS.items():
        used = getattr(plan, key) not in (None, 1)
        if used and target is not None and target not in targets:
            raise ValueError(
                f"parallel.plan.{key}={getattr(plan, key)} needs parallel._target_ "
                f"{' or '.join(targets)} ({_WHY[key]}), got {target}"
            )


def _check_context_parallel(plan: PlanConfig, model_config: Any) -> None:
    if getattr(model_config, "n_head", None) is None:
        raise ValueError(
            f"parallel.plan.cp={plan.cp} splits the sequences of a transformer (model=gpt_tiny "
            f"or moe_tiny); {type(model_config).__name__} has no attention"
        )
    if plan.ep > 1:
        raise ValueError(
            f"parallel.plan.cp ({plan.cp}) with parallel.plan.ep ({plan.ep}): the experts' "
            "reduction groups do not include cp in the training loop; use one of them"
        )
    if plan.dp_shard is not None:
        raise ValueError(
            f"parallel.plan.cp ({plan.cp}) with parallel.plan.dp_shard ({plan.dp_shard}): HSDP "
            "would shard over dp_shard x cp, a 2-D mesh torch builds only by slicing a "
            "flattened axis from the root mesh (deprecated); use ok.fsdp without dp_shard "
            "(it shards over dp x cp)"
        )


def data_shard(placement: Placement, rank: int) -> tuple[int, int]:
    """(index, count) of the batch shard ``rank`` reads: ranks differing only in
    ``SHARED_BATCH_AXES`` (``tp``, ``cp``, ``pp``) share one.

    The index numbers the mesh coordinates of the other axes, row-major in mesh order.
    """
    coord = [int(c[0]) for c in np.nonzero(placement.grid == rank)]
    axes = [i for i, name in enumerate(placement.mesh_dim_names) if name not in SHARED_BATCH_AXES]
    shape = [placement.shape[i] for i in axes]
    index = int(np.ravel_multi_index([coord[i] for i in axes], shape)) if axes else 0
    return index, math.prod(shape)


@dataclass(frozen=True, slots=True)
class Layout:
    """The groups and sub-meshes a run's wrappers use; without a placement, the world."""

    plan: PlanConfig
    placement: Placement | None = None
    mesh: DeviceMesh | None = None

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        if self.placement is None:
            return rank, world_size
        return data_shard(self.placement, rank)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ``dp`` group, ``dp x cp`` under context parallelism (None: the world, when
        there is no placement)."""
        if self.mesh is None:
            return None
        if self.plan.cp > 1:
            return self._flat(("dp", "cp")).get_group()
        return self.mesh["dp"].get_group()

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        if self.mesh is None:
            return None
        if self.plan.dp_shard is not None:
            return self.mesh["dp_replicate", "dp_shard"]
        if self.plan.cp > 1:
            return self._flat(("dp", "cp"))
        return self.mesh["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``cp`` mesh (None without context parallelism)."""
        return self.mesh["cp"] if self.mesh is not None and self.plan.cp > 1 else None

    def _flat(self, names: tuple[str, ...]) -> DeviceMesh:
        """The axes ``names`` as one 1-D mesh (torch caches it under the joined name), whose
        group has the default group's timeout."""
        assert self.mesh is not None
        # DeviceMesh has no public flatten yet; torchtitan uses _flatten the same way.
        axes = tuple(a for a in self.mesh.mesh_dim_names if a in names)  # mesh order
        flat = self.mesh[axes]._flatten("_".join(axes))
        inherit_timeout(flat.get_group())
        return flat

    @property
    def tp_mesh(self) -> DeviceMesh:
        assert self.mesh is not None, "tensor parallelism needs a placement"
        return self.mesh["tp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        assert self.mesh is not None, "expert parallelism needs a placement"
        return self.mesh["ep"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        assert self.mesh is not None, "pipeline parallelism needs a placement"
        return self.mesh["pp"]

    @property
    def dense_group(self) -> dist.ProcessGroup:
        """``dp x ep`` as one group: the replicas of every parameter outside the experts."""
        assert self.mesh is not None, "expert parallelism needs a placement"
        return self._flat(("dp", "ep")).get_group()

    def describe(self) -> str:
        if self.placement is None:
            return "world"
        sizes = self.placement.sizes
        return " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 rank"


def build_layout(plan: PlanConfig, topology: Any, device: torch.device) -> Layout:
    """Plan ``plan`` on ``topology`` and build the mesh (a collective: every rank calls it).

    Without a topology only plain data parallelism over the world is possible.

    Raises:
        ValueError: a non-trivial plan without a topology; the planner's own errors
            (sizes, domains; ``PlacementError`` proposes valid ones).
    """
    if topology is None:
        if not plan.trivial:
            raise ValueError(
                "parallel.plan needs a topology to place tp/ep/cp/pp/dp_shard on; use "
                "topology=detect or topology=preset (topology is null)"
            )
        return Layout(plan)
    placement = place(topology, **plan.plan_kwargs())
    mesh = placement.device_mesh(device.type)  # its groups have the default group's timeout
    logger.info(
        "mesh %s on %s: %s",
        dict(placement.sizes),
        topology.name,
        {
            a: placement.groups(a)
            for a in ("pp", "dp", "ep", "cp", "tp")
            if placement.dims.get(a, 1) > 1
        },
    )
    return Layout(plan, placement, mesh)
