"""A placement as its readers see it: what ``explain`` and ``penalties`` read of ``Placement``.

``Placement`` (``planner.placement``) calls those modules for its ``explain()``, ``to_dict()``
and refusals; they see it only through this Protocol, so no import runs back to
``placement``, not even for a type hint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from overlapkit.planner.grid import BlockViolation
from overlapkit.planner.traffic import CollectiveCost, Workload
from overlapkit.topology.model import Topology


class PlacementView(Protocol):
    """Parallel axes on a topology: the rank grid, its groups and their collectives.

    ``mesh_dim_names`` lists the axes outermost first, ``shape`` their sizes, ``ranks`` the grid
    row-major over ``shape``; ``layout`` is ``"traffic"``, ``"user"`` or ``"arange"``.
    """

    topology: Topology
    mesh_dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    workload: Workload
    layout: str
    notes: tuple[str, ...]
    violations: tuple[BlockViolation, ...]

    @property
    def world_size(self) -> int: ...

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, outermost first."""
        ...

    @property
    def dims(self) -> dict[str, int]:
        """The parallel dimensions (and the dp split, if any)."""
        ...

    @property
    def mesh(self) -> list:
        """The rank grid as nested lists, outermost axis first."""
        ...

    def groups(self, axes: str | Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The ranks of every group of ``axes``."""
        ...

    def collectives(self, algorithm: str | None = None) -> list[CollectiveCost]:
        """Every collective of a training step, with the predicted time."""
        ...

    def comm_time_s(self, algorithm: str | None = None) -> float:
        """Predicted communication per step, seconds, nothing overlapped."""
        ...
