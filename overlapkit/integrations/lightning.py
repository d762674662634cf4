"""Lightning: a DDP strategy built by ``ok.ddp``, or per-bucket optimizer updates without DDP.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the device is CUDA, so on
CPU/gloo a hook passed to it is silently dropped. ``OverlapDDPStrategy`` builds the DDP model with
``ok.ddp`` instead, in ``configure_ddp`` (its hook, ``bucket_mb``, ``compress`` including bf16 on
gloo, ``check_finite``); everything else is Lightning's ``DDPStrategy``. Importing this module
registers the names ``"overlapkit_ddp"`` and ``"overlapkit_ddp_spawn"`` with Lightning's strategy
registry.

``OverlapDDPStrategy(optimizer_overlap=True)`` builds no DDP: parameters and buffers are
broadcast from rank 0 (as DDP's constructor does), and ``ok.GradBucketer(module,
optimizer=opt)`` over the LightningModule and its configured optimizer applies each bucket's
update once its all-reduce is done (``overlapkit.optim.per_bucket``). The strategy's public
hooks in Lightning 2.6: ``configure_ddp`` builds no DDP; ``setup`` builds the bucketer;
``optimizer_step`` runs the closure, Lightning's hooks before the step with the norm clip
deferred into the bucketer (``_hooks_before_step``, the one use of Lightning's private API), and
``bucketer.step(scaler=...)`` in place of ``optimizer.step`` (16-mixed: then ``scaler.update()``);
``block_backward_sync`` (``accumulate_grad_batches``) is ``bucketer.no_sync()``;
``training_step`` / ``validation_step`` make the LightningModule's own parameters final first
(``bucketer.before_forward``), since Lightning calls those, not ``forward``; ``teardown`` applies
what is pending and detaches the bucketer.

FSDP2 needs no strategy of its own: Lightning's ``ModelParallelStrategy`` leaves sharding to
``LightningModule.configure_model``, where one line applies ``ok.fsdp``::

    def configure_model(self):
        ok.fsdp(self.net, mesh=self.device_mesh["data_parallel"], prefetch=1)

Example:
    >>> import overlapkit.integrations.lightning  # registers "overlapkit_ddp"
    >>> trainer = lightning.Trainer(strategy="overlapkit_ddp", accelerator="cpu", devices=2)
    >>> trainer = lightning.Trainer(strategy=OverlapDDPStrategy(compress="bf16"), devices=2)
    >>> strategy = OverlapDDPStrategy(optimizer_overlap=True)        # per-bucket updates
    >>> trainer = lightning.Trainer(strategy=strategy, gradient_clip_val=1.0, devices=2)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from overlapkit.ddp.bucketer import GradBucketer
from overlapkit.ddp.replicas import BufferCheck, broadcast_module_state
from overlapkit.ddp.wrap import ddp

__all__ = ["OverlapDDPStrategy"]

_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")
_STRATEGY_ARGUMENTS = frozenset(inspect.signature(DDPStrategy.__init__).parameters) - {
    "self",
    "kwargs",
}
"""``DDPStrategy``'s own arguments; it passes every other keyword to DDP, and so does this one."""
_PER_BUCKET = "OverlapDDPStrategy(optimizer_overlap=True)"
_USE_DDP = "use OverlapDDPStrategy() (DDP with ok.ddp's hook) instead"


class OverlapDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with the model wrapped by ``ok.ddp``, or per-bucket updates.

    Args:
        bucket_mb, check_finite, on_nonfinite: as in ``ok.ddp`` (and ``ok.GradBucketer``).
        compress, powersgd_options: as in ``ok.ddp``; not with ``optimizer_overlap``.
        optimizer_overlap (bool): no DDP: ``ok.GradBucketer(module, optimizer=opt)`` applies
            each bucket's update once its all-reduce is done, Lightning's norm clipping and
            16-mixed GradScaler folded in (module docstring; ``self.bucketer`` during fit).
            Defaults to False.
        forward_order_tail (int | None): with ``optimizer_overlap``, as in ``ok.GradBucketer``.
        **kwargs: ``DDPStrategy``'s arguments (``start_method``, ``timeout``,
            ``process_group_backend``...) and DDP options (``find_unused_parameters``,
            ``static_graph``...), except the comm-hook ones, which ``ok.ddp`` replaces; with
            ``optimizer_overlap`` no DDP options (no DDP is built).

    Raises:
        ValueError: ``ddp_comm_hook``, ``ddp_comm_state`` or ``ddp_comm_wrapper`` was given;
            with ``optimizer_overlap``, compression or DDP options were given; at ``fit``, a
            setup per-bucket updates cannot train as DDP would (manual optimization, a
            precision plugin other than 32-true / 16-mixed / bf16-mixed, value clipping,
            buffers that change), each named.
    """

    strategy_name = "overlapkit_ddp"

    def __init__(
        self,
        *,
        bucket_mb: float | str | None = None,
        compress: str | None = None,
        powersgd_options: dict[str, Any] | None = None,
        check_finite: bool = False,
        on_nonfinite: str = "raise",
        optimizer_overlap: bool = False,
        forward_order_tail: int | None = None,
        **kwargs: Any,
    ) -> None:
        given = [name for name in _HOOK_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(
                f"OverlapDDPStrategy: {given} cannot be combined with overlapkit's hook; choose "
                "the hook with compress=None|'bf16'|'fp16'|'powersgd', or use DDPStrategy"
            )
        super().__init__(**{k: v for k, v in kwargs.items() if k in _STRATEGY_ARGUMENTS})
        self._ddp_options = {k: v for k, v in kwargs.items() if k not in _STRATEGY_ARGUMENTS}
        self.bucketer: GradBucketer | None = None
        """With ``optimizer_overlap``: the bucketer of the current (or last) fit."""
        self._buffers: BufferCheck | None = None
        if optimizer_overlap:
            not_here = {"compress": compress, "powersgd_options": powersgd_options}
            not_here.update(self._ddp_options)
            named = sorted(k for k, v in not_here.items() if v is not None)
            if named:
                raise ValueError(
                    f"{_PER_BUCKET}: {named} apply to the DDP model, and per-bucket updates "
                    "build none (unused parameters are handled by the bucketer itself); drop "
                    f"them, or {_USE_DDP}"
                )
            self._bucketer_options: dict[str, Any] | None = dict(
                bucket_mb=bucket_mb,
                check_finite=check_finite,
                on_nonfinite=on_nonfinite,
                forward_order_tail=forward_order_tail,
            )
            return
        if forward_order_tail is not None:
            raise ValueError(
                f"OverlapDDPStrategy: forward_order_tail={forward_order_tail!r} orders the "
                "launches for per-bucket updates; it needs optimizer_overlap=True"
            )
        self._bucketer_options = None
        self._overlap_options = dict(
            bucket_mb=bucket_mb,
            compress=compress,
            powersgd_options=powersgd_options,
            check_finite=check_finite,
            on_nonfinite=on_nonfinite,
        )

    def configure_ddp(self) -> None:
        """``DDPStrategy.configure_ddp``: the DDP model built by ``ok.ddp``, which registers its
        hook on every backend; with ``optimizer_overlap``, no DDP: the parameters and buffers
        broadcast from rank 0, as DDP's constructor does."""
        if self._bucketer_options is not None:
            broadcast_module_state(self.model)
            return
        device_ids = self.determine_ddp_device_ids()
        # As DDPStrategy does: build DDP on a side stream on CUDA (PyTorch's CUDA notes).
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            self.model = ddp(
                self.model, device_ids=device_ids, **self._overlap_options, **self._ddp_options
            )

    def setup(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` (which configures the model, then the optimizers); with
        ``optimizer_overlap``, then the bucketer over the module and its optimizer."""
        super().setup(trainer)
        if self._bucketer_options is None or trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        _refuse_untested(module, self.optimizers, self.precision_plugin, trainer)
        self.bucketer = GradBucketer(module, optimizer=self.optimizers[0], **self._bucketer_options)
        self._buffers = BufferCheck(
            module,
            caller=_PER_BUCKET,
            fix=f"Make them constant (BatchNorm: track_running_stats=False), or {_USE_DDP}",
        )

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """DDP: Lightning's. Per-bucket: the closure, Lightning's hooks before the step with the
        norm clip deferred into the bucketer, ``bucketer.step(scaler=...)`` (module docstring)."""
        if self.bucketer is None or self._buffers is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if kwargs:
            raise ValueError(
                f"{_PER_BUCKET}: optimizer.step() keyword arguments {sorted(kwargs)} cannot be "
                "passed to a per-bucket step"
            )
        model = model or self.lightning_module
        loss = closure()
        if loss is None:
            raise RuntimeError(
                f"{_PER_BUCKET}: training_step returned None, so there was no backward to "
                "step on; skipping steps is not supported here (nor by Lightning on more than "
                "one device)"
            )
        self._buffers.check()
        precision = self.precision_plugin
        _hooks_before_step(precision, model, optimizer, self.bucketer)
        scaler = getattr(precision, "scaler", None)
        self.bucketer.step(scaler=scaler)
        if scaler is not None:
            scaler.update()
        return loss

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulation: backwards issue no communication (the bucketer's ``no_sync``)."""
        sync_off = self.bucketer.no_sync() if self.bucketer is not None else nullcontext()
        with sync_off, super().block_backward_sync():
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.bucketer is not None:
            self.bucketer.before_forward(self.lightning_module)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.bucketer is not None:
            self.bucketer.before_forward(self.lightning_module)
        return super().validation_step(*args, **kwargs)

    def teardown(self) -> None:
        """Apply the pending updates and detach the bucketer before Lightning's teardown (which
        moves the module to the CPU); ``self.bucketer`` keeps its statistics."""
        if self._buffers is not None:
            self._buffers = None
            self.bucketer.remove()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"overlapkit_ddp"`` (subprocess launch) and ``"overlapkit_ddp_spawn"``."""
        for name, start_method in (("overlapkit_ddp", "popen"), ("overlapkit_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"ok.ddp strategy with start_method {start_method!r}",
                    start_method=start_method,
                )


def _refuse_untested(
    module: pl.LightningModule,
    optimizers: list[torch.optim.Optimizer],
    precision: Precision,
    trainer: pl.Trainer,
) -> None:
    """What per-bucket updates cannot run as Lightning's DDP would, named at ``fit``."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{_PER_BUCKET}: manual optimization (automatic_optimization=False) calls "
            f"optimizer.step() itself, which per-bucket updates replace; {_USE_DDP}"
        )
    if len(optimizers) != 1:
        raise ValueError(f"{_PER_BUCKET}: needs exactly one optimizer, got {len(optimizers)}")
    if not (type(precision) is Precision or isinstance(precision, MixedPrecision)):
        raise ValueError(
            f"{_PER_BUCKET}: precision plugin {type(precision).__name__} is not supported; use "
            f"precision '32-true', '16-mixed' or 'bf16-mixed', or {_USE_DDP}"
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise ValueError(_value_clip_refused(trainer.gradient_clip_val))


def _value_clip_refused(clip_val: object) -> str:
    return (
        f"{_PER_BUCKET}: gradient_clip_algorithm='value' (gradient_clip_val={clip_val!r}) "
        "would edit the local gradients before they are all-reduced; use "
        f"gradient_clip_algorithm='norm' (folded into the per-bucket step), or {_USE_DDP}"
    )


def _hooks_before_step(
    precision: Precision,
    model: pl.LightningModule,
    optimizer: torch.optim.Optimizer,
    bucketer: GradBucketer,
) -> None:
    """Lightning's hooks between backward and the optimizer step (``on_before_optimizer_step``,
    then ``configure_gradient_clipping`` with Lightning's checks), the precision plugin's norm clip
    deferred into ``bucketer`` (over ``main_params(optimizer)``, in that order) and its value
    clip refused.

    The one place this adapter uses Lightning's private API, for want of a public path:
    Lightning runs these hooks only inside ``Precision.optimizer_step``, which hands the closure
    to ``optimizer.step`` and under 16-mixed first ``unscale_``-s the local gradients;
    ``Precision._after_closure`` is its part that runs them. A plugin's clipping
    (``clip_grad_by_norm``) is public to the plugin's own subclasses only, and the strategy keeps
    the user's plugin (whose class names its state in checkpoints), so its two clip methods are
    shadowed on that instance while the hooks run.
    """

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        bucketer.clip_grad_norm_(list(precision.main_params(optimizer)), clip_val)

    def clip_grad_by_value(_optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        raise ValueError(_value_clip_refused(clip_val))

    precision.clip_grad_by_norm = clip_grad_by_norm
    precision.clip_grad_by_value = clip_grad_by_value
    try:
        precision._after_closure(model, optimizer)
    finally:
        del precision.clip_grad_by_norm, precision.clip_grad_by_value


OverlapDDPStrategy.register_strategies(StrategyRegistry)
