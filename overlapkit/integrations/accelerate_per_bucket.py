"""Accelerate with per-bucket updates: ``use_ok_ddp(accelerator, optimizer_overlap=True)``.

No DDP is built: ``prepare`` hands the trainable model to Accelerate's own ``prepare_model(...,
evaluation_mode=True)`` (device placement, autocast, no wrapper; what the HF Trainer does for a
model sharded at load time), broadcasts its parameters and buffers from rank 0 (as DDP's
constructor does), and once ``prepare`` has seen both the model and its optimizer (in one call or
two) builds ``ok.GradBucketer(model, optimizer=opt)``. What each piece of Accelerate 1.15 becomes:

- the optimizer ``prepare`` returns is a ``PerBucketOptimizer``, Accelerate's
  ``AcceleratedOptimizer`` whose ``step`` is, on sync steps only as Accelerate's,
  ``bucketer.step(scaler=accelerator.scaler)``. With a GradScaler its ``step_was_skipped``
  (which ``optimizer_step_was_skipped`` and the prepared LR scheduler read) is
  ``bucketer.step_skipped()``, one host read of ``found_inf`` per step (on CUDA a device sync
  waiting for the last bucket's all-reduce; ``scaler.step`` itself reads it for any optimizer
  that is not ``fused``), then ``scaler.update()``.
- ``accelerator.clip_grad_norm_(parameters, max_norm, norm_type)`` records the clip
  (``bucketer.clip_grad_norm_``, over those parameters in that order) and returns the tensor
  the step writes the norm into. ``norm_ready_at_step=True`` (the default) makes it final when
  ``optimizer.step()`` returns (on CPU the step waits for every bucket's all-reduce; on CUDA the
  current stream waits for the norm, no host sync); ``False`` leaves it to whoever reads it to
  call ``make_norm_final()`` first (``OverlapTrainer`` does, on logging steps only), so other
  steps keep the all-reduce tail overlapped. ``clip_grad_value_`` is refused.
- ``accelerator.no_sync(model)`` (and so ``accumulate()``, and the HF Trainer's accumulation) is
  the bucketer's ``no_sync()``: without DDP, Accelerate's own does nothing.
- ``accelerator.unwrap_model`` and ``end_training``, after which users read the trained weights
  directly (``end_training`` also destroys the process group), apply every pending update
  first (``synchronize``). ``get_state_dict``, ``save_state`` and ``save_model`` need nothing:
  they read the model's ``state_dict()``, whose pre-hook applies them.

Accelerate has no public extension point for these on an ``Accelerator`` that exists already:
``PerBucketPreparation`` replaces the ``ACCELERATOR_METHODS`` and wraps the ``WEIGHT_READERS``
on that instance, in one place.

Refused (``ValueError``, at ``use_ok_ddp`` or ``prepare``): DeepSpeed, FSDP, XLA, Megatron and
``torch.compile`` through Accelerate, ``sync_each_batch=True``, a second trainable model or
optimizer, a model whose buffers change during training (``overlapkit.ddp.replicas``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend

from overlapkit.ddp.bucketer import GradBucketer
from overlapkit.ddp.replicas import BufferCheck, broadcast_module_state

__all__ = ["PerBucketOptimizer", "PerBucketPreparation"]

CALLER = "use_ok_ddp(optimizer_overlap=True)"
_DDP_INSTEAD = "use use_ok_ddp(accelerator) without optimizer_overlap (DDP) instead"
ACCELERATOR_METHODS = (
    "prepare_model",
    "prepare_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "no_sync",
)
"""The ``Accelerator`` methods ``PerBucketPreparation`` replaces on its accelerator (its own
methods of the same names)."""
WEIGHT_READERS = ("unwrap_model", "end_training")
"""The ``Accelerator`` methods after which users read the trained weights without
``state_dict()``: ``PerBucketPreparation`` applies the pending updates before each runs."""


class PerBucketPreparation:
    """What ``use_ok_ddp(accelerator, optimizer_overlap=True)`` installs on ``accelerator``.

    Args:
        accelerator (Accelerator): not prepared yet (``prepare`` has not seen the model).
        norm_ready_at_step (bool): the norm ``clip_grad_norm_`` returned is final when
            ``optimizer.step()`` returns (module docstring). Defaults to True.
        **bucketer_options: ``ok.GradBucketer``'s ``bucket_mb``, ``check_finite``,
            ``on_nonfinite``, ``forward_order_tail``.

    Raises:
        ValueError: a setup per-bucket updates refuse (module docstring), named.
    """

    def __init__(
        self, accelerator: Accelerator, *, norm_ready_at_step: bool = True, **bucketer_options: Any
    ):
        _refuse_untested(accelerator)
        self.accelerator = accelerator
        self.norm_ready_at_step = norm_ready_at_step
        self.model: torch.nn.Module | None = None
        self.optimizer: PerBucketOptimizer | None = None
        self.bucketer: GradBucketer | None = None
        """Built once ``prepare`` has seen the model and its optimizer."""
        self._bucketer_options = bucketer_options
        self._buffers: BufferCheck | None = None
        self._clip_asked = False
        self._norm_pending = False
        # Accelerate offers no public way to build no DDP in prepare, to clip or accumulate
        # otherwise, to choose the optimizer class prepare builds, or to run code before
        # unwrap_model / end_training: its methods are replaced (or wrapped) on this instance,
        # here only; its own stay in `_accelerate` for what they still do.
        self._accelerate: dict[str, Callable[..., Any]] = {
            name: getattr(accelerator, name) for name in ACCELERATOR_METHODS
        }
        for name in ACCELERATOR_METHODS:
            setattr(accelerator, name, getattr(self, name))
        for name in WEIGHT_READERS:
            setattr(accelerator, name, self._synchronized(getattr(accelerator, name)))

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """``Accelerator.prepare_model``, without the DDP wrapper for the trained model."""
        trains = not evaluation_mode and any(p.requires_grad for p in model.parameters())
        prepared = self._accelerate["prepare_model"](
            model, device_placement=device_placement, evaluation_mode=True
        )
        if trains:
            if self.model is not None and prepared is not self.model:
                raise ValueError(f"{CALLER}: prepare got a second trainable model; train one")
            self.model = prepared
            self._build_when_ready()
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> PerBucketOptimizer:
        """``Accelerator.prepare_optimizer``, returning a ``PerBucketOptimizer``."""
        if not isinstance(optimizer, PerBucketOptimizer):
            if device_placement is None:
                device_placement = self.accelerator.device_placement
            optimizer = PerBucketOptimizer(
                optimizer, self, device_placement=device_placement, scaler=self.accelerator.scaler
            )
            # Accelerate has no public way to register an optimizer of another class
            # (prepare_optimizer builds its AcceleratedOptimizer itself); with its marker of an
            # optimizer it prepared already, prepare_optimizer registers this one as it is (for
            # save_state, load_state and optimizer_step_was_skipped).
            optimizer._is_accelerate_prepared = True
        prepared = self._accelerate["prepare_optimizer"](optimizer, device_placement)
        if self.optimizer is not None and prepared is not self.optimizer:
            raise ValueError(f"{CALLER}: prepare got a second optimizer; train with one")
        self.optimizer = prepared
        self._build_when_ready()
        return prepared

    def _build_when_ready(self) -> None:
        if self.bucketer is not None or self.model is None or self.optimizer is None:
            return
        broadcast_module_state(self.model)  # what DDP's constructor does
        self.bucketer = GradBucketer(
            self.model, optimizer=self.optimizer.optimizer, **self._bucketer_options
        )
        self._buffers = BufferCheck(
            self.model,
            caller=CALLER,
            fix=f"Make them constant (BatchNorm: track_running_stats=False), or {_DDP_INSTEAD}",
        )

    def _ready(self) -> GradBucketer:
        if self.bucketer is None:
            raise RuntimeError(
                f"{CALLER}: accelerator.prepare has not seen both a trainable model and its "
                "optimizer yet; prepare both (in one call or two) before training"
            )
        return self.bucketer

    def step(self, scaler: torch.amp.GradScaler | None) -> bool:
        """The bucketer's step, for ``PerBucketOptimizer.step`` on a sync step.

        Returns:
            bool: whether the GradScaler skipped the step (False without a scaler).
        """
        bucketer = self._ready()
        self._buffers.check()
        bucketer.step(scaler=scaler)
        skipped = False
        if scaler is not None:
            skipped = bucketer.step_skipped()
            scaler.update()
        self._norm_pending, self._clip_asked = self._clip_asked, False
        if self.norm_ready_at_step:
            self.make_norm_final()
        return skipped

    def synchronize(self) -> None:
        """Apply every pending update (the bucketer's ``synchronize``; nothing before it is
        built), so that the model's parameters read directly are the trained ones."""
        if self.bucketer is not None:
            self.bucketer.synchronize()

    def _synchronized(self, accelerate: Callable[..., Any]) -> Callable[..., Any]:
        """Accelerate's ``accelerate`` with ``synchronize()`` first (``WEIGHT_READERS``)."""

        @functools.wraps(accelerate)
        def method(*args: Any, **kwargs: Any) -> Any:
            self.synchronize()
            return accelerate(*args, **kwargs)

        return method

    def make_norm_final(self) -> None:
        """Make the norm ``clip_grad_norm_`` returned for the last step final (waits for that
        step's all-reduces); no-op when it is final already or that step did not clip."""
        if self._norm_pending:
            self._norm_pending = False
            self.bucketer.total_norm()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type=2
    ) -> torch.Tensor:
        """``Accelerator.clip_grad_norm_``, folded into the coming step (module docstring)."""
        norm = self._ready().clip_grad_norm_(parameters, max_norm, norm_type)
        self._clip_asked = True
        return norm

    def clip_grad_value_(self, parameters: object, clip_value: float) -> None:
        """Refused: it would edit the local gradients before they are all-reduced."""
        raise ValueError(
            f"{CALLER}: clip_grad_value_(clip_value={clip_value!r}) would edit the local "
            "gradients before they are all-reduced; clip by norm (clip_grad_norm_, folded "
            f"into the step), or {_DDP_INSTEAD}"
        )

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """``Accelerator.no_sync``: the bucketer's ``no_sync()`` for the trained model."""
        if self.bucketer is not None and model is self.model:
            with self.bucketer.no_sync():
                yield
        else:
            with self._accelerate["no_sync"](model):
                yield


class PerBucketOptimizer(AcceleratedOptimizer):
    """The optimizer ``prepare`` returns under per-bucket updates (module docstring).

    Args:
        optimizer (torch.optim.Optimizer): the user's optimizer.
        preparation (PerBucketPreparation): holds the bucketer that steps it.
        device_placement (bool), scaler (GradScaler | None): as in ``AcceleratedOptimizer``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        preparation: PerBucketPreparation,
        *,
        device_placement: bool,
        scaler: torch.amp.GradScaler | None,
    ):
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self.preparation = preparation
        self.skipped = False
        """Whether the GradScaler skipped the last sync step's update."""

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """On sync steps (``accelerator.sync_gradients``), the bucketer's step with the
        accelerator's GradScaler; nothing on the others, as Accelerate's.

        Raises:
            ValueError: a ``closure`` (a step per bucket cannot run one).
        """
        if closure is not None:
            raise ValueError(f"{CALLER}: optimizer.step(closure) cannot run per bucket")
        if self.gradient_state.sync_gradients:
            self.skipped = self.preparation.step(self.scaler)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the GradScaler skipped the last update (what ``Accelerator.
        optimizer_step_was_skipped`` and the prepared LR scheduler read)."""
        return self.skipped


def _refuse_untested(accelerator: Accelerator) -> None:
    """What per-bucket updates cannot run as Accelerate's DDP would, named."""
    kind = accelerator.distributed_type
    if kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise ValueError(
            f"{CALLER}: Accelerate's distributed type {kind} is not supported; per-bucket "
            "updates replace DDP (MULTI_CPU or MULTI_GPU: several processes, one device each)"
        )
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise ValueError(
            f"{CALLER}: sync_each_batch=True reduces every micro-batch, while the bucketer "
            "reduces what accumulated once per step; drop sync_each_batch"
        )
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise ValueError(
            f"{CALLER}: torch.compile through Accelerate (dynamo_backend="
            f"{accelerator.state.dynamo_plugin.backend}) is not supported with per-bucket "
            f"updates; {_DDP_INSTEAD}"
        )
