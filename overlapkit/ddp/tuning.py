"""``bucket_mb="auto"`` for ``ok.ddp`` and ``ok.GradBucketer``: adapters around ``Tuner``.

``ok.ddp``: DistributedDataParallel fixes its bucket layout when it builds its C++ ``Reducer``
(plus one rebuild in gradient-ready order at the second forward). To try another bucket size the
tuner builds a *new reducer on the same DDP object*, exactly as DDP's own ``__setstate__`` does
after unpickling (``_build_params_for_reducer`` -> ``_build_debug_param_to_name_mapping`` ->
``_ddp_init_helper``), then registers the comm hooks again. Why this and not a new DDP around
the module:

- the object the user holds stays the same ``DistributedDataParallel``: same ``.module``, same
  parameters (so the optimizer stays valid), ``no_sync()``, ``state_dict()`` keys, ``isinstance``;
- a new DDP would broadcast every parameter from rank 0 and check shapes across ranks
  (collectives) at construction, and the old reducer would keep its autograd hooks until it was
  garbage-collected. Here the old reducer is dropped at once and its destructor removes its
  autograd hooks (``Reducer::~Reducer`` calls ``remove_autograd_hooks``), so exactly one reducer
  fires per gradient. Nothing in the switch is a collective: every rank rebuilds locally at the
  same step boundary, because the decision is shared.

A new reducer behaves like a fresh one: its first step reduces everything in one bucket and its
second forward rebuilds the buckets in rank 0's gradient-ready order, so each DDP trial discards
two steps. This relies on the DDP internals that ``__setstate__`` uses (checked on torch 2.13).

Steps are delimited by a forward pre-hook on the DDP module that reacts only when a synchronised
backward finished since the last one (the comm recorder's step counter moved), so
``no_sync()`` micro-batches and evaluation forwards do not count. ``GradBucketer``'s reducer calls
the tuner at the end of each ``wait()`` (a step-end hook) and switches by rebuilding its buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp.comm_stats import BucketCommRecord, CommRecorder
from overlapkit.tuning.decide import bucket_ladder, is_auto
from overlapkit.tuning.report import register_tuner
from overlapkit.tuning.search import Tuner

if TYPE_CHECKING:
    from overlapkit.ddp.reducer import BucketReducer

MiB = 1024 * 1024
DDP_DISCARD_STEPS = 2
BUCKETER_DISCARD_STEPS = 1
MEASURE_STEPS = 3


def set_ddp_bucket_mb(model: DistributedDataParallel, bucket_mb: float) -> None:
    """Give ``model`` a new reducer whose buckets hold ``bucket_mb`` MiB; call between steps."""
    config = getattr(model, "_bucket_config", None)
    if config is not None:
        model._bucket_config = type(config).create(
            bucket_cap_mb=bucket_mb,
            bucket_cap_mb_list=None,
            use_python_reducer=model._use_python_reducer,
        )
        model.bucket_bytes_cap = model._bucket_config.bucket_bytes_cap
    else:
        # torch before the _BucketCapacityConfig refactor reads these two attributes.
        model.bucket_bytes_cap = int(bucket_mb * MiB)
        model.bucket_bytes_cap_default = False
    parameters, expect_sparse_gradient = model._build_params_for_reducer()
    param_to_name_mapping = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(
        parameters, expect_sparse_gradient, param_to_name_mapping, model.static_graph
    )
    if model.static_graph:
        # As DDP._set_static_graph does: the new reducer's first step must be the delayed
        # all-reduce of every gradient, which DDP's Python side queues only while this flag is
        # False (without it the new reducer never reduced a gradient: each rank stepped alone).
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
        model._static_graph_delay_allreduce_enqueued = False
    for hook, state in model._comm_hooks:
        dist._register_comm_hook(model.reducer, state, hook)
    model._has_rebuilt_buckets = False


def _param_bytes(params: Sequence[torch.Tensor]) -> list[int]:
    return [p.numel() * p.element_size() for p in params]


def exposed_tails(records: Sequence[BucketCommRecord], tags: list[int]) -> list[float]:
    """Per tagged step, the last completion minus the last launch of its buckets, ms.

    The last bucket is launched when backward's last gradient is ready, so this is the part of
    communication left after backward compute (the exposed tail). A step without
    records gives 0.
    """
    tails = []
    for tag in tags:
        rows = [r for r in records if r.step == tag and r.done_ms is not None]
        tails.append(max(r.done_ms for r in rows) - max(r.launch_ms for r in rows) if rows else 0.0)
    return tails


def _tails_from(recorder: CommRecorder):
    def extras(tags: list[int]) -> tuple[list[float], None]:
        return exposed_tails(recorder.snapshot().records, tags), None

    return extras


def attach_ddp_tuner(
    model: DistributedDataParallel,
    params: Sequence[torch.nn.Parameter],
    group: dist.ProcessGroup,
    recorder: CommRecorder,
) -> Tuner:
    """Tune ``model``'s bucket size over its first steps (see the module docstring).

    Args:
        model (DistributedDataParallel): from ``ok.ddp``, before its first step.
        params: its trainable parameters (registration order); the candidates are
            ``bucket_ladder`` of their gradient bytes in reverse registration order.
        group (ProcessGroup): its process group.
        recorder (CommRecorder): its comm recorder.

    Returns:
        Tuner: also readable with ``ok.tuning_report(model)``.
    """
    if getattr(model, "mixed_precision", None) is not None:
        raise ValueError(
            "ok.ddp: bucket_mb='auto' does not support DDP's own mixed_precision argument; "
            "pass a number of MiB"
        )
    ladder = bucket_ladder(_param_bytes(params)[::-1])
    handle = None
    seen_step: list[int | None] = [None]

    def detach() -> None:
        handle.remove()

    tuner = Tuner(
        knob="bucket_mb",
        candidates=ladder,
        apply=lambda mb: set_ddp_bucket_mb(model, mb),
        detach=detach,
        group=group,
        device=params[0].device,
        extras=_tails_from(recorder),
        discard_steps=DDP_DISCARD_STEPS,
        measure_steps=MEASURE_STEPS,
        caller="ok.ddp",
    )

    def pre_forward(_module: torch.nn.Module, _args: object) -> None:
        if not torch.is_grad_enabled() or recorder.step == seen_step[0]:
            return
        seen_step[0] = recorder.step
        tuner.step_ended(recorder.step - 1)

    handle = model.register_forward_pre_hook(pre_forward)
    register_tuner(model, tuner)
    return tuner


def attach_bucketer_tuner(owner: object, reducer: BucketReducer) -> Tuner:
    """Tune a ``GradBucketer``'s bucket size from its reducer's step ends.

    The tuner runs as a step-end hook of ``reducer`` (after the first step's adoption of rank
    0's gradient-ready order, where the first trial's clock starts) and switches sizes with
    ``reducer.set_bucket_mb``; once settled the hook is removed.

    Args:
        owner (object): the ``GradBucketer`` the user holds (``ok.tuning_report(owner)``).
        reducer (BucketReducer): its reducer, before the first step.
    """
    params = reducer.params
    ladder = bucket_ladder(_param_bytes(params)[::-1])
    handle = None

    def detach() -> None:
        handle.remove()

    tuner = Tuner(
        knob="bucket_mb",
        candidates=ladder,
        apply=reducer.set_bucket_mb,
        detach=detach,
        group=reducer.process_group,
        device=params[0].device,
        extras=_tails_from(reducer.recorder),
        first_step=1,
        discard_steps=BUCKETER_DISCARD_STEPS,
        measure_steps=MEASURE_STEPS,
        caller="ok.GradBucketer",
    )
    handle = reducer.register_step_end_hook(tuner.step_ended)
    register_tuner(owner, tuner)
    return tuner


def wants_auto_bucket_mb(bucket_mb: object, *, caller: str, compress: str | None = None) -> bool:
    """Whether ``bucket_mb`` is ``"auto"``; other strings and PowerSGD with auto are refused.

    Raises:
        ValueError: a string other than ``"auto"``, or ``"auto"`` with ``compress="powersgd"``
            (PowerSGD keeps error-feedback state per bucket index, which a new layout breaks).
    """
    auto = is_auto(bucket_mb, knob="bucket_mb", caller=caller, expected="a number of MiB, None")
    if auto and compress == "powersgd":
        raise ValueError(
            f"{caller}: bucket_mb='auto' cannot be combined with compress='powersgd' (its "
            "per-bucket state does not survive a new bucket layout); pass a number of MiB"
        )
    return auto
