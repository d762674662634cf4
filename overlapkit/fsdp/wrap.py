"""``ok.fsdp``: FSDP2 (``fully_shard``) per block, then the root, with prefetch that overlaps."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from overlapkit.fsdp.blocks import BlockSpec, resolve_blocks
from overlapkit.fsdp.comms import BlockAllGather
from overlapkit.fsdp.failed_step import FailedStep
from overlapkit.fsdp.keywords import (
    check_divides_shard_axis,
    check_reshard_after_forward,
    frees_after_forward,
    resolve_mixed_precision,
    resolve_mp_policy,
    resolve_offload_policy,
)
from overlapkit.fsdp.mesh import resolve_mesh
from overlapkit.fsdp.prefetch import set_explicit_prefetch, warn_if_prefetch_replaced
from overlapkit.fsdp.reduce_scatter import (
    BlockReduceScatter,
    ExplainedReduceScatter,
    PendingReductions,
)
from overlapkit.fsdp.replica_all_reduce import explain_replica_all_reduce
from overlapkit.fsdp.state import OverlapState, is_registered, register_state
from overlapkit.fsdp.stats import ROOT, UnshardRecorder
from overlapkit.fsdp.tuning import attach_prefetch_tuner
from overlapkit.fsdp.zero import resolve_reshard_after_forward
from overlapkit.group.consistency import check_consistent
from overlapkit.group.failures import FailureScope
from overlapkit.group.process_group import resolve_process_group
from overlapkit.tuning.decide import AUTO, check_max_memory, prefetch_candidates

logger = logging.getLogger(__name__)

PREFETCH_DEPTHS = (0, 1, 2)


def _validate_prefetch(prefetch: int) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(
            f"ok.fsdp: prefetch must be an int in {list(PREFETCH_DEPTHS)} or {AUTO!r}, got "
            f"{prefetch!r}"
        )
    if prefetch not in PREFETCH_DEPTHS:
        raise ValueError(
            f"ok.fsdp: prefetch={prefetch} is not supported; choose one of "
            f"{list(PREFETCH_DEPTHS)} (0 = FSDP2's default, d = all-gathers of the next d "
            "blocks in flight while one computes; each adds one unsharded block of memory)"
        )
    return prefetch


def _check_not_wrapped(model: nn.Module) -> None:
    if is_registered(model):
        raise ValueError("ok.fsdp: this model was already returned by ok.fsdp(); wrap it once")
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "ok.fsdp: the model is wrapped in DistributedDataParallel; pass the plain module "
            "(model.module) instead"
        )
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"sub-module {name!r}" if name else "the model"
            raise ValueError(
                f"ok.fsdp: {where} ({type(module).__name__}) is already sharded with "
                "fully_shard; pass a model that FSDP has not been applied to"
            )


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"ok.fsdp: {name} must be a bool, got {value!r}")
    return value


def _device_type(model: nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()}
    if not devices:
        raise ValueError(f"ok.fsdp: the model ({type(model).__name__}) has no parameters")
    if len(devices) > 1:
        raise ValueError(
            f"ok.fsdp: the model's parameters are on several device types {sorted(devices)}; "
            "move the model to one device first"
        )
    return devices.pop()


def _unsharded_bytes(module: nn.Module, policy: MixedPrecisionPolicy) -> int:
    """Bytes of ``module``'s parameters when all-gathered (in ``param_dtype`` if set)."""
    return sum(p.numel() * (policy.param_dtype or p.dtype).itemsize for p in module.parameters())


def _own_parameters(root: nn.Module, blocks: list[nn.Module]) -> Callable[[], list[nn.Parameter]]:
    """A function returning the root's parameters outside every block, as registered now."""
    block_ids = {id(b) for b in blocks}

    def params() -> list[nn.Parameter]:
        found: list[nn.Parameter] = []
        stack = [root]
        while stack:
            module = stack.pop()
            found.extend(module.parameters(recurse=False))
            stack.extend(c for c in module.children() if id(c) not in block_ids)
        return found

    return params


def fsdp(
    model: nn.Module,
    *,
    prefetch: int | str = 1,
    mesh: DeviceMesh | None = None,
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    blocks: BlockSpec = None,
    overlap_reduce_scatter: bool = True,
    max_memory: int | None = None,
    zero: int | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2, block by block, with all-gather prefetch that overlaps.

    Each block is ``fully_shard``-ed, then the root. With ``prefetch=d >= 1``, while block i
    computes, the all-gathers of blocks i+1..i+d are in flight (backward: i-1..i-d). On CUDA
    this is FSDP2's explicit prefetch on its streams. On host devices (gloo) FSDP2's streams
    are no-ops and its unshard waits for the collective, so ``ok.fsdp`` also installs comms that
    issue the all-gathers (and, when safe, reduce-scatters) asynchronously; see
    ``overlapkit.fsdp.comms``.

    ``fully_shard``'s own keywords keep their names and meanings (``mp_policy``,
    ``offload_policy``, an int ``reshard_after_forward``; ``overlapkit.fsdp.keywords``), so a
    script's ``fully_shard(block, **fsdp_kwargs)`` calls become ``ok.fsdp(model,
    **fsdp_kwargs)``. A script's own ``set_modules_to_forward_prefetch`` /
    ``set_modules_to_backward_prefetch`` afterwards replace ``ok.fsdp``'s: it warns once, before
    the next forward, and ``ok.fsdp_stats`` reports the bound of the lists in force
    (``overlapkit.fsdp.prefetch_lists``).

    Args:
        model (nn.Module): the model, not yet sharded, on its device or on the meta device
            (``torch.device("meta")``: ``to_empty`` it onto the mesh's device and initialise it
            after ``ok.fsdp``, as with ``fully_shard``); changed in place.
        prefetch (int): 0 (FSDP2's default behaviour, nothing added), 1 or 2 blocks of
            all-gathers in flight ahead of the computing one. Defaults to 1. ``"auto"`` tries
            the depths that fit ``max_memory`` during the first steps and keeps the fastest
            (``overlapkit.fsdp.tuning``, ``ok.tuning_report``).
        mesh (DeviceMesh | None): 1-D (FSDP over its ranks) or 2-D (HSDP; axis 0 replicates,
            axis 1 shards). None means a 1-D mesh over the world, on the parameters' device or,
            for a meta-device model, the default process group's (``fully_shard``'s rule). The
            mesh's device type picks the overlap path.
        mixed_precision (str | MixedPrecisionPolicy | None): None (parameter dtype),
            ``"bf16"`` (bf16 parameters in compute, fp32 gradient reduction) or a policy.
        mp_policy (MixedPrecisionPolicy | None): ``fully_shard``'s name for a policy; not with
            ``mixed_precision``.
        offload_policy (OffloadPolicy | None): as in ``fully_shard`` (``CPUOffloadPolicy``);
            None is no offloading.
        reshard_after_forward (bool | int | None): free each block's unsharded parameters after
            its forward and gather them again in backward; an int ``k`` (a divisor of the shard
            axis) keeps a ``1/k`` shard over groups of ``k`` ranks instead, as in
            ``fully_shard``. None (the default) means True, or False under ``zero``.
        blocks: which modules to shard one by one (see ``overlapkit.fsdp.blocks``); None finds
            the largest list of same-class modules. Blocks must run in this order.
        overlap_reduce_scatter (bool): on host devices with ``prefetch >= 1``, use overlapkit's
            reduce-scatter (``overlapkit.fsdp.reduce_scatter``): all-to-all based on gloo, and
            running while backward continues (1-D meshes). Defaults to True.
        max_memory (int | None): with ``prefetch="auto"`` only: most bytes of unsharded block
            parameters allowed at once (what ``ok.fsdp_stats(model).peak_bytes`` measures);
            None means no bound.
        zero (int | None): a lower ZeRO stage on FSDP2 (``overlapkit.fsdp.zero``): 1 shards the
            optimizer state only (per step one all-gather and one reduce-scatter per block,
            gradients accumulated whole), 2 the gradients too (one reduce-scatter per
            micro-batch). The parameters stay gathered from a step's first forward to its last
            backward; run every micro-batch but the last under ``overlapkit.fsdp.no_sync``.
            None (the default) is FSDP2's ZeRO-3.

    Returns:
        nn.Module: ``model`` itself, now an ``FSDPModule``; ``ok.fsdp_stats(model)`` reads its
        memory accounting.

    Raises:
        ValueError: ``prefetch`` not in {0, 1, 2}, unknown ``mixed_precision`` or both it and
            ``mp_policy``, ``blocks`` matching nothing, a mesh of the wrong size or shape, a
            model already wrapped, ``zero`` not in {1, 2}, ``zero`` with a
            ``reshard_after_forward`` other than None or False, an int ``reshard_after_forward``
            that does not divide the shard axis, or a pinned ``CPUOffloadPolicy`` where no
            accelerator is.
        ConfigMismatch: the ranks passed different options or models
            (``overlapkit.group.consistency``, over each axis of the mesh; one 32-byte
            all-gather per axis when they agree).
        TypeError: an argument of the wrong type.
        RuntimeError: torch.distributed is not initialised.

    A collective of a later step that fails (a rank died or is stuck) raises
    ``ok.CollectiveFailure`` from the forward or ``loss.backward()``, after every gradient of
    the model has been set to None, so an ``optimizer.step()`` after catching it changes
    nothing; the next forward resets FSDP2's state first (``overlapkit.fsdp.failed_step``).

    Example:
        >>> model = ok.fsdp(model, prefetch=1, mixed_precision="bf16")
        >>> loss = model(x).sum(); loss.backward(); optimizer.step()
        >>> ok.fsdp_stats(model).steps[-1].forward_peak_blocks   # <= 1 + prefetch
    """
    # As given ("auto" unresolved), for the cross-rank consistency check.
    options: dict[str, object] = dict(
        prefetch=prefetch,
        mixed_precision=mixed_precision,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        overlap_reduce_scatter=overlap_reduce_scatter,
        max_memory=max_memory,
        zero=zero,
    )
    settings = _resolve_settings(**options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"ok.fsdp: model must be an nn.Module, got {type(model).__name__}")
    _check_not_wrapped(model)
    block_list = resolve_blocks(model, blocks)
    resolve_process_group(None, caller="ok.fsdp")
    mesh = resolve_mesh(mesh, _device_type(model))
    settings.check_mesh(mesh)
    names = {id(module): name for name, module in model.named_modules()}
    block_names = tuple(names[id(block)] for block in block_list)
    block_bytes = tuple(_unsharded_bytes(block, settings.policy) for block in block_list)
    mesh_options = dict(blocks=block_names, mesh=(tuple(mesh.shape), mesh.mesh_dim_names))
    _check_ranks_agree(model, mesh, options | mesh_options)
    candidates = settings.prefetch_candidates(block_bytes)
    prefetch = max(candidates)  # comms are set up for the deepest candidate

    apply_fully_shard(model, block_list, mesh, settings, prefetch)
    state = OverlapState(
        root=model,
        blocks=block_list,
        block_names=block_names,
        block_bytes=block_bytes,
        prefetch=prefetch,
        device_type=mesh.device_type,  # a meta model's is the mesh's
        reshard_after_forward=settings.frees_after_forward,
        recorder=UnshardRecorder(block_list, block_bytes),
        pending=PendingReductions(),
        zero=zero,
    )
    comms = _install_overlap(state, mesh, settings.overlap_reduce_scatter)
    register_state(model, state)
    if settings.auto_prefetch:
        attach_prefetch_tuner(model, state, candidates, settings.max_memory)
    _log_wrapped(state, mesh, mixed_precision or mp_policy, settings.policy, comms)
    return model


@dataclass(frozen=True, slots=True)
class _Settings:
    """``ok.fsdp``'s options, checked; ``prefetch`` is 0 while ``auto_prefetch`` is set."""

    prefetch: int
    auto_prefetch: bool
    max_memory: int | None
    reshard_after_forward: bool | int
    """For ``fully_shard``; an int is checked against the mesh by ``check_mesh``."""
    overlap_reduce_scatter: bool
    policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy

    @property
    def frees_after_forward(self) -> bool:
        """Whether blocks hold no unsharded parameters between forward and backward."""
        return frees_after_forward(self.reshard_after_forward)

    def check_mesh(self, mesh: DeviceMesh) -> None:
        """Raise unless an int ``reshard_after_forward`` divides ``mesh``'s shard axis."""
        check_divides_shard_axis(self.reshard_after_forward, mesh.shape[-1])

    def prefetch_candidates(self, block_bytes: tuple[int, ...]) -> tuple[int, ...]:
        """The depths to try: those that fit ``max_memory`` under ``"auto"``, else the one given."""
        if not self.auto_prefetch:
            return (self.prefetch,)
        return tuple(
            prefetch_candidates(
                block_bytes, self.max_memory, reshard_after_forward=self.frees_after_forward
            )
        )


def _resolve_settings(
    *,
    prefetch: int | str,
    mixed_precision: str | MixedPrecisionPolicy | None,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool | int | None,
    overlap_reduce_scatter: bool,
    max_memory: int | None,
    zero: int | None,
) -> _Settings:
    """Check ``ok.fsdp``'s options (raising as its docstring says) and resolve their defaults."""
    auto_prefetch = prefetch == AUTO
    max_memory = check_max_memory(max_memory, auto=auto_prefetch)
    return _Settings(
        prefetch=0 if auto_prefetch else _validate_prefetch(prefetch),
        auto_prefetch=auto_prefetch,
        max_memory=max_memory,
        reshard_after_forward=check_reshard_after_forward(
            resolve_reshard_after_forward(zero, reshard_after_forward)
        ),
        overlap_reduce_scatter=_check_bool(overlap_reduce_scatter, "overlap_reduce_scatter"),
        policy=resolve_mixed_precision(resolve_mp_policy(mixed_precision, mp_policy)),
        offload_policy=resolve_offload_policy(offload_policy),
    )


def _check_ranks_agree(model: nn.Module, mesh: DeviceMesh, options: dict[str, object]) -> None:
    """Raise ``ConfigMismatch`` unless the mesh's ranks passed the same options and model.

    Over the mesh's ranks, one group per axis (together they connect all of them): ranks outside
    the mesh, such as other pipeline stages, wrap other modules.
    """
    for axis in range(mesh.ndim):
        check_consistent(model, mesh.get_group(axis), caller="ok.fsdp", options=options)


def apply_fully_shard(
    model: nn.Module,
    block_list: list[nn.Module],
    mesh: DeviceMesh,
    settings: _Settings,
    prefetch: int,
) -> None:
    """``fully_shard`` each block, then the root, and set FSDP2's explicit prefetch to ``prefetch``.

    The root keeps FSDP2's automatic choice of resharding (not resharded: backward needs it at
    once).
    """
    for block in block_list:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=settings.reshard_after_forward,
            mp_policy=settings.policy,
            offload_policy=settings.offload_policy,
        )
    fully_shard(model, mesh=mesh, mp_policy=settings.policy, offload_policy=settings.offload_policy)
    set_explicit_prefetch(model, block_list, prefetch)


@dataclass(frozen=True, slots=True)
class _HostComms:
    """Which of overlapkit's own collectives replace FSDP2's.

    ``async_gather``: all-gathers issued asynchronously (host devices with prefetch, where FSDP2's
    streams are no-ops). ``host_reduce``: overlapkit's reduce-scatter as well.
    """

    async_gather: bool
    host_reduce: bool

    @classmethod
    def choose(cls, device_type: str, prefetch: int, overlap_reduce_scatter: bool) -> _HostComms:
        async_gather = device_type == "cpu" and prefetch > 0
        return cls(async_gather, async_gather and overlap_reduce_scatter)


@dataclass(frozen=True, slots=True)
class _CommTarget:
    """One ``fully_shard``-ed module: a block (``index >= 0``) or the root (``ROOT``).

    ``params`` returns the parameters it reduces, as registered when called.
    """

    index: int
    module: nn.Module
    where: str
    name: str
    params: Callable[[], Iterable[nn.Parameter]]


def _install_overlap(
    state: OverlapState, mesh: DeviceMesh, overlap_reduce_scatter: bool
) -> _HostComms:
    """Install the recorder's comms and hooks on every sharded module of ``state``.

    Returns which of overlapkit's own collectives replaced FSDP2's.
    """
    model, block_list, block_names = state.root, state.blocks, state.block_names
    recorder, pending = state.recorder, state.pending
    # A failed collective drops the step's gradients before it is raised (fsdp.failed_step).
    failed_step = FailedStep(model)
    failures = FailureScope("ok.fsdp", lambda: recorder.step, on_failure=failed_step)
    comms = _HostComms.choose(state.device_type, state.prefetch, overlap_reduce_scatter)
    targets = [
        _CommTarget(i, block, f"block {i} ({block_names[i]!r})", block_names[i], block.parameters)
        for i, block in enumerate(block_list)
    ]
    targets.append(_CommTarget(ROOT, model, "the root", "root", _own_parameters(model, block_list)))
    for target in targets:
        _install_comms(target, comms, mesh, recorder, pending, failures)
    _install_hooks(state, failed_step)
    return comms


def _log_wrapped(
    state: OverlapState,
    mesh: DeviceMesh,
    mixed_precision: str | MixedPrecisionPolicy | None,
    policy: MixedPrecisionPolicy,
    comms: _HostComms,
) -> None:
    logger.info(
        "ok.fsdp: %d blocks (%s), prefetch=%d, mesh %s, mixed_precision=%s, zero=%s, "
        "async all-gather=%s, overlapkit reduce-scatter=%s",
        len(state.blocks),
        type(state.blocks[0]).__name__,
        state.prefetch,
        tuple(mesh.shape),
        policy if isinstance(mixed_precision, MixedPrecisionPolicy) else mixed_precision,
        state.zero,
        comms.async_gather,
        comms.host_reduce,
    )


def _install_comms(
    target: _CommTarget,
    comms: _HostComms,
    mesh: DeviceMesh,
    recorder: UnshardRecorder,
    pending: PendingReductions,
    failures: FailureScope,
) -> None:
    """Set ``target``'s all-gather and reduce-scatter; explain its replica all-reduce (HSDP)."""
    module, where = target.module, target.where
    module.set_custom_all_gather(
        BlockAllGather(
            target.index,
            recorder,
            force_async=comms.async_gather,
            failures=failures,
            where=where,
        )
    )
    if comms.host_reduce:
        reduce_scatter = BlockReduceScatter(
            lambda: list(target.params()),
            pending,
            target.name,
            # On a 2-D mesh FSDP2 all-reduces the output at once, even over 1 replica.
            allow_async=mesh.ndim == 1,
            failures=failures,
            where=where,
        )
    else:  # FSDP2's own reduce-scatter, only explained when it fails
        reduce_scatter = ExplainedReduceScatter(failures=failures, where=where)
    module.set_custom_reduce_scatter(reduce_scatter)
    if mesh.ndim == 2:
        explain_replica_all_reduce(
            module, reduce_scatter, mesh.get_group(0), failures=failures, where=where
        )


def _install_hooks(state: OverlapState, failed_step: FailedStep) -> None:
    """The recorder's hooks, the recovery from a failed step, and the warning when a script
    replaced the prefetch lists (``warn_if_prefetch_replaced``). The block hooks are
    registered after ``fully_shard``'s, so they run after FSDP2's: just before the block
    computes, just after it reshards. The root's pre-hook is prepended, so it runs before
    FSDP2's root pre-forward.

    Under ``torch.compile`` the hooks run eagerly (``torch.compiler.disable``), as FSDP2's own
    do: they sit where FSDP2's hooks already split the graph, and traced they would only add
    graph breaks of their own (``time.perf_counter``, ``Work.is_completed``: 7 for a 3-block
    transformer, ``tests/test_compile.py``)."""

    root, blocks, recorder, pending = state.root, state.blocks, state.recorder, state.pending

    def root_pre_forward(*_: object) -> None:
        # Reduce-scatters of a backward that raised are still pending; never leave them behind.
        pending.wait_all()
        failed_step.reset_if_failed()  # before FSDP2's pre-forward reads its per-step state
        recorder.root_pre_forward()
        warn_if_prefetch_replaced(state)

    eager = torch.compiler.disable
    root.register_forward_pre_hook(eager(root_pre_forward), prepend=True)
    root.register_forward_hook(eager(lambda *_: recorder.root_post_forward()))
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(eager(lambda *_, i=i: recorder.compute_start(i)))
        block.register_forward_hook(
            eager(lambda _m, _in, out, i=i: recorder.block_post_forward(i, out))
        )
