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
``accelerator.no_sync``. The norm is read (``grad_norm.item()``) only when the trainer logs,
right after the callbacks' ``on_step_end`` (or ``on_epoch_end``) have set
``control.should_log``; ``OverlapTrainer``'s callback, run after every other, makes it final
there (``make_norm_final()``) and nowhere else: the other steps keep the all-reduce tail
overlapped. ``train()`` returns with every update applied (the callback's ``on_train_end``), so
weights read right after it are the trained ones, as with the plain Trainer. The optimizer may be
the default ``create_optimizer`` one (two param groups) or the user's, made before or after the
model is prepared. Everything goes through the Trainer's public
extension points (``create_accelerator_and_postprocess``, a ``TrainerCallback``, ``train``).

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

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from overlapkit.integrations.accelerate import use_ok_ddp
from overlapkit.integrations.accelerate_per_bucket import PerBucketPreparation

__all__ = ["OverlapTrainer", "PerBucketCallback"]


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
        self._per_bucket_callback: PerBucketCallback | None = None
        super().__init__(*args, **kwargs)
        if self.overlap is not None:
            self._per_bucket_callback = PerBucketCallback(self.overlap)
            self.add_callback(self._per_bucket_callback)

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s, then ``use_ok_ddp`` on the accelerator it created."""
        super().create_accelerator_and_postprocess()
        options = self._overlapkit_options
        if options.get("optimizer_overlap"):
            # The loop reads the norm only when it logs, and makes it final there.
            self.overlap = use_ok_ddp(self.accelerator, norm_ready_at_step=False, **options)
        else:
            use_ok_ddp(self.accelerator, **options)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with per-bucket updates, ``PerBucketCallback`` moved after the
        callbacks added since, so that it sees ``control.should_log`` as they leave it."""
        if self._per_bucket_callback is not None:
            self.pop_callback(self._per_bucket_callback)
            self.add_callback(self._per_bucket_callback)
        return super().train(*args, **kwargs)


class PerBucketCallback(TrainerCallback):
    """``OverlapTrainer``'s part in the Trainer's loop under per-bucket updates: the clipped norm
    made final where the Trainer reads it, on the steps it logs, and nowhere else; every pending
    update applied when training ends.

    Args:
        overlap (PerBucketPreparation): what ``use_ok_ddp`` installed on the Trainer's
            accelerator.
    """

    def __init__(self, overlap: PerBucketPreparation):
        self.overlap = overlap

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The Trainer logs right after this event when ``control.should_log``."""
        if control.should_log:
            self.overlap.make_norm_final()

    on_epoch_end = on_step_end  # the Trainer also logs right after on_epoch_end

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """``train()`` returns with every update applied: weights read after it (statistics,
        an EMA, a save by the user's own code) are the trained ones, as with the plain
        Trainer."""
        self.overlap.synchronize()
