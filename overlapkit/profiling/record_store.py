"""Compact per-event records of one trace, in blocks that move to disk past a memory budget.

The analysis keeps a few numbers per kernel, operator and launch (``rank_trace``), about 25
bytes where the trace spends 200, but a trace's size has no limit. Each ``RecordTable`` holds
its rows as numpy structured arrays in blocks of ``BLOCK_ROWS``; all tables of one trace share a
``SpillStore``, and once their blocks in memory pass its budget, the oldest go to a temporary
directory (removed with the store). Each block keeps the range of its key fields, so
``select`` reads only the blocks that can hold rows in a range: a trace written in time order
(Kineto writes each thread's and stream's events in order) is read one window of steps at a
time with about one block per table in memory, whatever the file's size.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK_ROWS = 1 << 17
DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass(slots=True)
class _Block:
    rows: np.ndarray | None
    """In memory, or None once written to ``path``."""
    path: Path | None
    count: int
    ranges: dict[str, tuple[float, float]]
    """Per key field, its (min, max) in the block."""


class SpillStore:
    """The memory budget shared by the tables of one trace, and where spilled blocks go.

    Args:
        budget_bytes (int): bytes of blocks kept in memory before the oldest are written to
            disk. Defaults to ``DEFAULT_BUDGET_BYTES``.
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self.resident: list[tuple[RecordTable, _Block]] = []
        self.resident_bytes = 0
        self.spilled_bytes = 0
        self._dir: Path | None = None
        self._files = 0

    def _path(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="overlapkit-records-"))
        self._files += 1
        return self._dir / f"{self._files}.npy"

    def admit(self, table: RecordTable, block: _Block) -> None:
        self.resident.append((table, block))
        self.resident_bytes += block.rows.nbytes
        while self.resident_bytes > self.budget_bytes and len(self.resident) > 1:
            _, oldest = self.resident.pop(0)
            self.resident_bytes -= oldest.rows.nbytes
            self.spilled_bytes += oldest.rows.nbytes
            oldest.path = self._path()
            np.save(oldest.path, oldest.rows, allow_pickle=False)
            oldest.rows = None

    def close(self) -> None:
        """Remove the spilled blocks."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(slots=True)
class RecordTable:
    """Rows of one structured dtype, appended in file order, read back by key range.

    Args:
        dtype (np.dtype): the row type.
        keys (tuple[str, ...]): fields whose range each block records, for ``select``.
        store (SpillStore): the budget this table counts against.
    """

    dtype: np.dtype
    keys: tuple[str, ...]
    store: SpillStore
    blocks: list[_Block] = field(default_factory=list)
    pending: list[np.ndarray] = field(default_factory=list)
    pending_rows: int = 0

    def append(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        self.pending.append(rows)
        self.pending_rows += len(rows)
        if self.pending_rows >= BLOCK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Make the pending rows a block."""
        if not self.pending:
            return
        rows = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.pending_rows = [], 0
        ranges = {k: (float(rows[k].min()), float(rows[k].max())) for k in self.keys}
        block = _Block(rows=rows, path=None, count=len(rows), ranges=ranges)
        self.blocks.append(block)
        self.store.admit(self, block)

    def __len__(self) -> int:
        return sum(b.count for b in self.blocks) + self.pending_rows

    @staticmethod
    def _load(block: _Block) -> np.ndarray:
        return block.rows if block.rows is not None else np.load(block.path, allow_pickle=False)

    def iter_blocks(self) -> Iterator[np.ndarray]:
        """Every block's rows, in file order (flush first)."""
        for block in self.blocks:
            yield self._load(block)

    def select(self, key: str, lo: float, hi: float) -> np.ndarray:
        """The rows with ``lo <= row[key] < hi``, in file order."""
        parts = []
        for block in self.blocks:
            low, high = block.ranges[key]
            if high < lo or low >= hi:
                continue
            rows = self._load(block)
            column = rows[key]
            parts.append(rows[(column >= lo) & (column < hi)])
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def overlapping(self, lo: float, hi: float) -> np.ndarray:
        """The rows with ``start < hi`` and ``end > lo`` (fields ``start`` and ``end``)."""
        parts = []
        for block in self.blocks:
            if block.ranges["start"][0] >= hi or block.ranges["end"][1] <= lo:
                continue
            rows = self._load(block)
            parts.append(rows[(rows["start"] < hi) & (rows["end"] > lo)])
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def all(self) -> np.ndarray:
        """Every row (for a trace that fits in memory)."""
        parts = list(self.iter_blocks())
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)
