"""HF Transformers: a ``Trainer`` whose DDP model gets ``ok.ddp``'s hook.

``Trainer`` has no comm-hook argument; it builds its ``Accelerator`` in
``create_accelerator_and_postprocess`` (from ``__init__``) and the DDP model in ``train()``
through ``accelerator.prepare``. ``OverlapTrainer`` calls
``overlapkit.integrations.accelerate.use_ok_ddp`` on that accelerator, so ``train()``'s DDP model
carries ``ok.ddp``'s hook. DDP options keep coming from ``TrainingArguments``
(``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters``...).

Example:
    >>> trainer = OverlapTrainer(model=model, args=args, train_dataset=data,
    ...                          overlapkit_options={"compress": "bf16"})
    >>> trainer.train()
    >>> ok.comm_stats(trainer.model_wrapped)
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from overlapkit.integrations.accelerate import use_ok_ddp

__all__ = ["OverlapTrainer"]


class OverlapTrainer(Trainer):
    """``transformers.Trainer`` with ``ok.ddp``'s hook on the DDP model it trains.

    Args:
        *args, **kwargs: ``Trainer``'s arguments.
        overlapkit_options (dict | None): keyword arguments of ``use_ok_ddp``
            (``compress``, ``check_finite``, ``on_nonfinite``, ``powersgd_options``); the bucket
            size comes from ``TrainingArguments(ddp_bucket_cap_mb=...)``.
    """

    def __init__(self, *args: Any, overlapkit_options: dict[str, Any] | None = None, **kwargs: Any):
        # Read by create_accelerator_and_postprocess, which Trainer.__init__ calls.
        self._overlapkit_options = dict(overlapkit_options or {})
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_ok_ddp(self.accelerator, **self._overlapkit_options)
