"""One description of a training layout, from the lowest layer that needs it up.

``TrainingLayout``: a complete layout, checked (parallel sizes, micro-batching, interleaving,
recomputation, sharding): what the auto-planner chooses, ``ok.plan`` places
(``Placement.training``), overlapkit-train runs and the benchmarks price. ``PartialLayout``:
some of its choices, the others free: the search's pins, ``ok.plan``'s sizes, overlapkit-train's
``parallel.plan``, the doctor's ``--tp`` ... ``overlapkit_train``: what overlapkit-train runs,
one table its checks and the search both read.

A leaf: it imports nothing of overlapkit but ``overlapkit.validation``.
"""

from overlapkit.layout.partial_layout import ALL_LAYERS, CHOICES, PartialLayout
from overlapkit.layout.training_layout import DIMS, RECOMPUTE, SHARDING, TrainingLayout

__all__ = [
    "ALL_LAYERS",
    "CHOICES",
    "DIMS",
    "RECOMPUTE",
    "SHARDING",
    "PartialLayout",
    "TrainingLayout",
]
