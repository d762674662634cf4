"""Auto-tuning: ``bucket_mb="auto"`` (``ok.ddp``, ``ok.GradBucketer``) and ``prefetch="auto"``
(``ok.fsdp``) measure a few candidates during the first steps, agree across ranks, and settle.

``decide`` holds the pure rules (candidates, trial order, choice, memory bound), ``search`` the
measuring glue shared by both knobs, ``ddp`` and ``fsdp`` the adapters, ``report`` what was
tried and chosen (``ok.tuning_report``).
"""

from overlapkit.tuning.report import Trial, TuningReport, tuning_report

__all__ = ["Trial", "TuningReport", "tuning_report"]
