"""Auto-tuning: ``bucket_mb="auto"`` (``ok.ddp``, ``ok.GradBucketer``) and ``prefetch="auto"``
(``ok.fsdp``) measure a few candidates during the first steps, agree across ranks, and settle.

``decide`` holds the pure rules (candidates, trial order, choice, memory bound), ``search`` the
measuring glue shared by both knobs, ``report`` what was tried and chosen (``ok.tuning_report``).
A leaf: the adapters that attach a tuner to a wrapper live with the wrapper
(``overlapkit.ddp.tuning``, ``overlapkit.fsdp.tuning``), so this package imports neither.
"""

from overlapkit.tuning.report import Trial, TuningReport, tuning_report

__all__ = ["Trial", "TuningReport", "tuning_report"]
