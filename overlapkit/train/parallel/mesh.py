"""The run's mesh: the ``parallel.plan`` sizes checked, placed by ``ok.plan``, turned into groups.

The ``parallel`` group's ``plan`` section holds the run's parallel sizes (``tp``, ``ep``, ``cp``,
``pp``, ``dp``, ``dp_shard``, ``virtual_stages``: ``PlanConfig.sizes``, the layout's own
description) and what only overlapkit-train adds (the pipeline's ``schedule``, the mesh
``order``); the rest of the group is the wrapper's factory. Every worker plans on the run's
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
from overlapkit.inlayer.sequence_parallel import DEFAULT_TP_CHUNKS, SYNC, TP_COMMS
from overlapkit.layout import PartialLayout
from overlapkit.layout.overlapkit_train import wrapper_refusal
from overlapkit.planner import Placement
from overlapkit.planner import plan as place

logger = logging.getLogger(__name__)

PLAN_KEY = "plan"
"""The key of the ``parallel`` group that holds the run's parallel sizes."""
PLAN_SIZES = ("tp", "ep", "cp", "pp", "dp", "dp_shard", "virtual_stages")
"""The ``parallel.plan`` keys that are the layout's own choices (``PartialLayout``'s)."""
RUN_SIZES = PartialLayout(tp=1, ep=1, cp=1, pp=1, virtual_stages=1)
"""A run's sizes where ``parallel.plan`` gives none (``dp``: what is left of the world)."""


def config_key(key: str) -> str:
    """A ``parallel.plan`` size as the config spells it: ``parallel.plan.tp``."""
    return f"parallel.{PLAN_KEY}.{key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """``parallel.plan``: the run's parallel sizes and what only overlapkit-train adds to them.

    ``sizes`` is the layout's own description (``overlapkit.layout.PartialLayout``, checked by
    it), every size set: 1 where the config gives none, except ``dp``, None for
    ``parallel.plan.dp=-1`` (whatever is left of the world), and ``dp_shard``, None without
    HSDP. Its ``sharding`` is left free: the ``parallel`` group's wrapper says it
    (``run_layout``).
    """

    sizes: PartialLayout = RUN_SIZES
    schedule: str = "1F1B"
    """The ``torch.distributed.pipelining`` schedule with ``pp > 1``
    (``overlapkit.layout.overlapkit_train.SCHEDULES``)."""
    order: tuple[str, ...] | None = None
    """Mesh axes outermost first, overriding the planner's traffic order (``ok.plan(order=)``)."""
    ep_chunks: int = 1
    """Token chunks each MoE layer's dispatch and combine are pipelined in with its experts
    (``overlapkit.inlayer.chunked_ep``); 1 is the synchronous exchange."""
    tp_comm: str = SYNC
    """How tensor parallel's collectives meet its matmuls: ``sync``, ``split`` (the micro-batch
    in ``tp_chunks`` chunks) or ``ring`` (``overlapkit.inlayer.sequence_parallel.TP_COMMS``)."""
    tp_chunks: int = DEFAULT_TP_CHUNKS
    """With ``tp_comm=split``: chunks of each micro-batch; must divide ``train.batch_size``."""

    @classmethod
    def of(cls, **section: Any) -> PlanConfig:
        """The ``parallel.plan`` section's keys, checked.

        Raises:
            TypeError / ValueError: an unknown key (the valid ones listed) or a bad value,
                named ``parallel.plan.<key>``.
        """
        valid = (*PLAN_SIZES, "schedule", "order", "ep_chunks", "tp_comm", "tp_chunks")
        unknown = sorted(set(section) - set(valid))
        if unknown:
            raise ValueError(
                f"{config_key(unknown[0])} is not a planner size the training loop uses; "
                f"valid: {', '.join(valid)}"
            )
        sizes = {key: section[key] for key in PLAN_SIZES if key in section}
        if sizes.get("dp") == -1:
            sizes["dp"] = None
        order = section.get("order")
        return cls(
            sizes=PartialLayout.from_mapping(RUN_SIZES.given() | sizes, spell=config_key),
            schedule=section.get("schedule", "1F1B"),
            order=None if order is None else tuple(str(axis) for axis in order),
            ep_chunks=positive_count(section, "ep_chunks", 1),
            tp_comm=_tp_comm(section.get("tp_comm", SYNC)),
            tp_chunks=positive_count(section, "tp_chunks", DEFAULT_TP_CHUNKS),
        )

    @property
    def trivial(self) -> bool:
        """Plain data parallelism over the world (what a run without a topology can do)."""
        sizes = self.sizes
        return (sizes.tp, sizes.ep, sizes.cp, sizes.pp, sizes.dp_shard) == (1, 1, 1, 1, None)

    def dp(self, world_size: int) -> int:
        """The data-parallel size on ``world_size`` ranks (``parallel.plan.dp``, or the rest)."""
        sizes = self.sizes
        return sizes.dp or world_size // (sizes.tp * sizes.ep * sizes.cp * sizes.pp)


def positive_count(section: Mapping[str, Any], key: str, default: int) -> int:
    """``section[key]`` (``default`` when absent), an integer >= 1.

    Raises:
        ValueError: anything else, named ``parallel.plan.<key>``.
    """
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{config_key(key)} must be an integer >= 1, got {value!r}")
    return value


def _tp_comm(value: object) -> str:
    if value not in TP_COMMS:
        raise ValueError(
            f"{config_key('tp_comm')} must be one of {', '.join(TP_COMMS)}, got {value!r}"
        )
    return str(value)


def split_parallel(parallel: Mapping[str, Any]) -> tuple[PlanConfig, dict[str, Any]]:
    """The ``parallel`` group as (its ``plan`` section, the wrapper factory's config).

    Raises:
        ValueError / TypeError: an unknown key or a bad value in ``parallel.plan``.
    """
    factory = {k: v for k, v in parallel.items() if k != PLAN_KEY}
    return PlanConfig.of(**dict(parallel.get(PLAN_KEY) or {})), factory


SHARED_BATCH_AXES = ("tp", "cp", "pp")
"""Mesh axes whose ranks read the same batches (each computes its part of them; a pipeline's
first stage reads the inputs, its last the targets)."""


def check_plan(plan: PlanConfig, *, world_size: int, model_config: Any, target: str | None) -> None:
    """Refuse sizes that cannot work, before any worker starts; messages name the config keys.

    What overlapkit-train does not run of a layout is ``check_layout``'s (the capability
    table); these are the sizes against the world, the model and the wrapper.

    Args:
        plan (PlanConfig): the ``parallel.plan`` sizes.
        world_size (int): ``launcher.nnodes x launcher.nproc_per_node``.
        model_config: the model's config (``GPTConfig``, ``MoEConfig``, ``MLPConfig``).
        target (str | None): ``parallel._target_``, the wrapper factory.

    Raises:
        ValueError: sizes that do not multiply to (or divide) the world size, ``dp_shard`` not
            a divisor of dp above 1, ``tp`` not dividing ``n_head``, ``ep`` not dividing
            ``n_expert``, a model without heads or experts for tp, ep or cp, a wrapper that
            cannot reduce such a layout.
    """
    _check_world(plan, world_size)
    sizes = plan.sizes
    if sizes.tp > 1:
        _check_divides(sizes.tp, "tp", model_config, "n_head")
    if sizes.ep > 1:
        _check_divides(sizes.ep, "ep", model_config, "n_expert")
    if sizes.cp > 1 and getattr(model_config, "n_head", None) is None:
        raise ValueError(
            f"parallel.plan.cp={sizes.cp} splits the sequences of a transformer (model=gpt_tiny "
            f"or moe_tiny); {type(model_config).__name__} has no attention"
        )
    for key in ("tp", "ep", "dp_shard"):
        refusal = wrapper_refusal(key, getattr(sizes, key), target)
        if refusal is not None:
            raise ValueError(refusal)


def check_ep_chunks(plan: PlanConfig, *, batch_size: int, seq_len: int | None) -> None:
    """Refuse an ``ep_chunks`` that cannot run: above 1 without ep, or more chunks than tokens.

    Raises:
        ValueError: one line naming ``parallel.plan.ep_chunks`` and the constraint.
    """
    chunks = plan.ep_chunks
    if chunks == 1:
        return
    if plan.sizes.ep == 1:
        raise ValueError(
            f"parallel.plan.ep_chunks={chunks} pipelines expert parallelism's all-to-alls; "
            "parallel.plan.ep is 1 (set parallel.plan.ep > 1, or ep_chunks=1)"
        )
    tokens = batch_size * (seq_len or 1)
    if chunks > tokens:
        raise ValueError(
            f"parallel.plan.ep_chunks={chunks} must be at most the tokens each rank routes per "
            f"micro-batch (train.batch_size x data.seq_len = {tokens})"
        )


def _check_world(plan: PlanConfig, world_size: int) -> None:
    sizes = plan.sizes
    axes = {"tp": sizes.tp, "ep": sizes.ep}
    axes |= {name: n for name, n in (("cp", sizes.cp), ("pp", sizes.pp)) if n > 1}
    fixed = math.prod(axes.values())
    formula = (
        " x ".join(config_key(a) for a in axes) + " = " + " x ".join(str(n) for n in axes.values())
    )
    where = "launcher.nnodes x launcher.nproc_per_node"
    if sizes.dp is None and world_size % fixed:
        raise ValueError(
            f"{formula} = {fixed} does not divide the world size {world_size} ({where})"
        )
    if sizes.dp is not None and fixed * sizes.dp != world_size:
        raise ValueError(
            f"{formula} x parallel.plan.dp ({sizes.dp}) = {fixed * sizes.dp}, but the world size "
            f"is {world_size} ({where}); use parallel.plan.dp=-1 for whatever is left"
        )
    dp, shard = plan.dp(world_size), sizes.dp_shard
    if shard is not None and (dp % shard or shard == 1):
        raise ValueError(
            f"parallel.plan.dp_shard ({shard}) must divide the data-parallel size {dp} and be "
            "above 1 (one rank per shard group shards nothing: use parallel=ddp)"
        )


_SPLITS = {
    "n_head": ("a transformer (model=gpt_tiny or moe_tiny)", "attention heads"),
    "n_expert": ("a mixture-of-experts model (model=moe_tiny)", "experts"),
}


def _check_divides(size: int, key: str, model_config: Any, attribute: str) -> None:
    """``parallel.plan.<key>`` splits the model's ``attribute`` (its heads, its experts)."""
    count = getattr(model_config, attribute, None)
    needs, what = _SPLITS[attribute]
    if count is None:
        raise ValueError(
            f"{config_key(key)}={size} needs {needs}; {type(model_config).__name__} has no {what}"
        )
    if count % size:
        raise ValueError(
            f"{config_key(key)} ({size}) must divide model.config.{attribute} ({count})"
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
        if self.plan.sizes.cp > 1:
            return self._flat(("dp", "cp")).get_group()
        return self.mesh["dp"].get_group()

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        if self.mesh is None:
            return None
        if self.plan.sizes.dp_shard is not None:
            return self.mesh["dp_replicate", "dp_shard"]
        if self.plan.sizes.cp > 1:
            return self._flat(("dp", "cp"))
        return self.mesh["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``cp`` mesh (None without context parallelism)."""
        return self.mesh["cp"] if self.mesh is not None and self.plan.sizes.cp > 1 else None

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
    placement = place(topology, **plan.sizes.placement_sizes(), order=plan.order)
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
