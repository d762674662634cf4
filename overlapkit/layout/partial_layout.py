"""Some of a training layout's choices, the others left free: what a caller fixes.

The auto-planner's pins (``overlapkit plan --auto --tp 2``, ``ok.plan(..., auto=True, tp=2)``,
``--json``'s ``fixed``, ``parallel=auto``'s ``parallel.pins``) leave the free choices to the
search; ``ok.plan(topo, tp=2)``, overlapkit-train's ``parallel.plan`` and the doctor's ``--tp``
place the sizes they give, a free size being 1 and a free ``dp`` what is left of the world
(``placement_sizes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from overlapkit.layout.training_layout import (
    DIMS,
    Spelling,
    TrainingLayout,
    as_named,
    check_choice,
    check_pairs,
)

ALL_LAYERS = "all"
"""``recompute_layers`` fixed to every layer of each stage (``TrainingLayout``'s None)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartialLayout:
    """A ``TrainingLayout``'s choices, each optional (None: free); checked as given.

    ``num_micro_batches`` is not a choice of its own: the global batch and ``micro_batch`` set it.
    ``recompute="full"`` without ``recompute_layers`` leaves the number of recomputed layers
    free.

    Raises:
        TypeError / ValueError: as ``TrainingLayout`` for each value given (``recompute_layers``
            may also be ``"all"``), and pairs that disagree (``dp_shard`` without hsdp,
            ``recompute_layers`` without recompute full), naming them.
    """

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    micro_batch: int | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    recompute_layers: int | Literal["all"] | None = None
    sharding: str | None = None
    dp_shard: int | None = None
    schedule: str | None = None
    """The pipeline schedule, torch's name (``1F1B`` and ``Interleaved1F1B`` included: what
    ``TrainingLayout.pipeline_schedule`` says)."""

    def __post_init__(self) -> None:
        check_partial(self.given())

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], *, spell: Spelling = as_named
    ) -> PartialLayout:
        """The choices in ``values`` (None values are free), errors spelled by ``spell``.

        Raises:
            ValueError: a key that is no choice (the valid ones listed), or a bad value.
        """
        given = {key: value for key, value in values.items() if value is not None}
        unknown = [key for key in given if key not in CHOICES]
        if unknown:
            raise ValueError(f"cannot fix {unknown[0]!r}; valid: {', '.join(CHOICES)}")
        check_partial(given, spell)
        return cls(**given)

    @classmethod
    def of(cls, layout: TrainingLayout) -> PartialLayout:
        """Every choice of ``layout`` fixed (``recompute_layers`` ``"all"`` for full of every
        layer, ``dp_shard`` with hsdp only)."""
        values = {key: getattr(layout, key) for key in CHOICES} | {
            "schedule": layout.pipeline_schedule
        }
        if layout.recompute == "full" and layout.recompute_layers is None:
            values["recompute_layers"] = ALL_LAYERS
        return cls(**values)

    def given(self) -> dict[str, Any]:
        """The fixed choices, in field order (``--json``'s ``fixed``)."""
        return {key: getattr(self, key) for key in CHOICES if getattr(self, key) is not None}

    @property
    def sizes(self) -> dict[str, int]:
        """The parallel sizes given (``tp``, ``pp``, ``dp``, ``cp``, ``ep``)."""
        return {key: getattr(self, key) for key in DIMS if getattr(self, key) is not None}

    @property
    def layers_recomputed(self) -> int | None:
        """The recomputed layers per stage when fixed to a count (None: every layer or free)."""
        return None if self.recompute_layers in (None, ALL_LAYERS) else self.recompute_layers

    def placement_sizes(self) -> dict[str, int | None]:
        """``ok.plan``'s sizes placing this: a free size 1, a free ``dp`` -1 (the rest)."""
        sizes: dict[str, int | None] = {
            key: 1 if getattr(self, key) is None else getattr(self, key)
            for key in ("tp", "ep", "cp", "pp")
        }
        return sizes | {"dp": -1 if self.dp is None else self.dp, "dp_shard": self.dp_shard}

    def admits(self, layout: TrainingLayout) -> bool:
        """Whether ``layout`` makes every fixed choice (``recompute_layers`` ``"all"``: None)."""
        fixed = self.given()
        if fixed.get("recompute_layers") == ALL_LAYERS:
            fixed["recompute_layers"] = None
        chosen = {key: getattr(layout, key) for key in fixed} | (
            {"schedule": layout.pipeline_schedule} if "schedule" in fixed else {}
        )
        return all(chosen[key] == value for key, value in fixed.items())


CHOICES = tuple(f.name for f in fields(PartialLayout))
"""The choices a caller can fix, in ``ok.plan``'s order."""


def check_partial(given: Mapping[str, Any], spell: Spelling = as_named) -> None:
    """The choices ``given`` checked (see ``PartialLayout``).

    Raises:
        TypeError / ValueError: a bad value or pair, spelled by ``spell``.
    """
    for key, value in given.items():
        if not (key == "recompute_layers" and value == ALL_LAYERS):
            check_choice(key, value, spell)
    if "recompute_layers" in given and "recompute" not in given:
        raise ValueError(
            f"{spell('recompute_layers')}={given['recompute_layers']!r} goes with "
            f"{spell('recompute')}=full"
        )
    check_pairs(given, spell)
