"""HF Transformers: a ``Trainer`` whose DDP model gets ``ok.ddp``'s hook, or per-bucket updates.

``Trainer`` has no comm-hook argument; it builds its ``Accelerator`` in
``create_accelerator_and_postprocess`` (from ``__init__``) and the DDP model in ``train()``
through ``accelerator.prepare``. ``OverlapTrainer`` calls
``overlapkit.integrations.accelerate.use_ok_ddp`` on that accelerator, so ``train()``'s DDP model
carries ``ok.ddp``'s hook. DDP options keep coming from ``TrainingArguments``
(``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters``...).

With ``overlapkit_options={"optimizer_overlap": True}`` the accelerator builds no DDP and
``train()`` steps per bucket (``overlapkit.integrations.accelerate_per_bucket``). Where
transformers 5.24's loop plugs in: ``_clip_grad_norm`` calls ``accelerator.clip_grad_norm_(
model.parameters(), max_grad_norm)`` only when ``max_grad_norm > 0``, and at 0
``_get_grad_norm`` measures with ``max_norm=inf`` (so no step is ever asked to clip to 0.0,
which would zero the gradients); both are folded into the next ``optimizer.step()``; the LR
scheduler is stepped unless ``accelerator.optimizer_step_was_skipped``; accumulation goes through
``accelerator.no_sync``. The norm is read (``grad_norm.item()``) only in
``_maybe_log_save_evaluate`` on logging steps, so the trainer makes it final there
(``bucketer.total_norm()``) and nowhere else: the other steps keep the all-reduce tail
overlapped. The optimizer may be the default ``create_optimizer`` one (two param groups) or the
user's, made before or after the model is prepared.

Example:
    >>> trainer = OverlapTrainer(model=model, args=args, train_dataset=data,
    ...                          overlapkit_options={"compress": "bf16"})
    >>> trainer.train()
    >>> ok.comm_stats(trainer.model_wrapped)
    >>> trainer = OverlapTrainer(model=model, args=args, train_dataset=data,
    ...                          overlapkit_options={"optimizer_overlap": True})
    >>> trainer.train()
    >>> ok.comm_stats(trainer.overlap.bucketer)
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from overlapkit.integrations.accelerate import use_ok_ddp
from overlapkit.integrations.accelerate_per_bucket import PerBucketPreparation

__all__ = ["OverlapTrainer"]


class OverlapTrainer(Trainer):
    """``transformers.Trainer`` with ``ok.ddp``'s hook on the DDP model it trains, or with
    per-bucket optimizer updates and no DDP.

    Args:
        *args, **kwargs: ``Trainer``'s arguments.
        overlapkit_options (dict | None): keyword arguments of ``use_ok_ddp``
            (``compress``, ``check_finite``, ``on_nonfinite``, ``powersgd_options``, or
            ``optimizer_overlap=True`` with ``bucket_mb`` and ``forward_order_tail``); the DDP
            bucket size comes from ``TrainingArguments(ddp_bucket_cap_mb=...)``.

    Raises:
        ValueError: with ``optimizer_overlap``: DeepSpeed, FSDP, ``torch_compile``,
            ``sync_each_batch`` or another setup ``use_ok_ddp`` refuses (named).
    """

    def __init__(self, *args: Any, overlapkit_options: dict[str, Any] | None = None, **kwargs: Any):
        # Read by create_accelerator_and_postprocess, which Trainer.__init__ calls.
        self._overlapkit_options = dict(overlapkit_options or {})
        self.overlap: PerBucketPreparation | None = None
        """With ``optimizer_overlap``: what holds the bucketer (``self.overlap.bucketer``)."""
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        options = self._overlapkit_options
        if options.get("optimizer_overlap"):
            # The loop reads the norm only when it logs, and makes it final there.
            self.overlap = use_ok_ddp(self.accelerator, norm_ready_at_step=False, **options)
        else:
            use_ok_ddp(self.accelerator, **options)

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any):
        if self.overlap is not None and grad_norm is not None and self.control.should_log:
            self.overlap.bucketer.total_norm()  # writes the tensor grad_norm is
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
