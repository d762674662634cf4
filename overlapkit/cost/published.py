"""Published nccl-tests bus bandwidths, and how far the cost model's predictions are from them.

``data/published_busbw.tsv`` holds one row per measurement read in a public source (nccl-tests
and NCCL issues, cloud vendors' benchmark pages): the system, the preset it is (plus YAML
overrides where the hardware differs, e.g. an H800's 8 NVLinks), group size, collective, size,
the algorithm when the source forced one, the busbw in GB/s, the source and the quoted sentence.
``validate()`` predicts each row with ``estimate`` and reports the error;
``overlapkit estimate --validate`` prints the table.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from overlapkit.cost.estimate import Estimate, estimate
from overlapkit.topology.loading import PRESET_DIR, load_topology, parse_topology_yaml
from overlapkit.topology.model import Topology
from overlapkit.topology.units import parse_size

TOLERANCE = 0.15
"""Every row must be predicted within +-15 % (issue 15), or say why not (``MISS_MARKER``)."""
MISS_MARKER = "Outside +-15 %:"
"""Starts the explanation, in a row's notes, of why the model misses it (with the evidence)."""
SPLITS = ("fit", "held_out")
COLUMNS = (
    "id",
    "split",
    "system",
    "topology",
    "overrides",
    "gpus",
    "collective",
    "bytes",
    "algorithm",
    "busbw_GBps",
    "nccl",
    "source",
    "quote_and_notes",
)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One published busbw: where it was measured and what was read."""

    id: str
    split: str
    """``fit`` (sets a fitted constant) or ``held_out`` (only checks the model)."""
    system: str
    topology: str
    """Preset spec, ``<preset>`` or ``<preset>x<N>``."""
    overrides: tuple[tuple[str, object], ...]
    """``(dotted YAML key, value)`` applied to the preset, e.g. ``("scale_up.links", 8)``."""
    gpus: int
    collective: str
    nbytes: float
    algorithm: str | None
    """None: the library's own choice; else forced (like ``NCCL_ALGO``) as the source did."""
    busbw_GBps: float
    nccl: str
    source: str
    notes: str


@dataclass(frozen=True, slots=True)
class Check:
    """A measurement beside the model's prediction."""

    measurement: Measurement
    estimate: Estimate

    @property
    def error(self) -> float:
        """``predicted / published - 1``."""
        return self.estimate.busbw_GBps / self.measurement.busbw_GBps - 1

    @property
    def within_tolerance(self) -> bool:
        return abs(self.error) <= TOLERANCE

    @property
    def explained_miss(self) -> bool:
        """The row's notes explain why the model misses it (``MISS_MARKER``)."""
        return MISS_MARKER in self.measurement.notes

    @property
    def accepted(self) -> bool:
        """Within the tolerance, or outside it with the reason in the row's notes."""
        return self.within_tolerance or self.explained_miss

    def to_dict(self) -> dict:
        measured = self.measurement
        return {
            "id": measured.id,
            "split": measured.split,
            "system": measured.system,
            "topology": measured.topology,
            "gpus": measured.gpus,
            "collective": measured.collective,
            "bytes": measured.nbytes,
            "published_busbw_GBps": measured.busbw_GBps,
            "predicted_busbw_GBps": self.estimate.busbw_GBps,
            "algorithm": self.estimate.algorithm,
            "error": self.error,
            "explained_miss": self.explained_miss and not self.within_tolerance,
            "source": measured.source,
        }


def default_path() -> Path:
    """The shipped measurements file."""
    return Path(str(resources.files("overlapkit.cost") / "data" / "published_busbw.tsv"))


def load_measurements(path: str | Path | None = None) -> list[Measurement]:
    """Read the measurements file (``#`` lines are comments).

    Raises:
        ValueError: a missing column, an unknown split, or a value that does not parse; the
            message names the file, the row id and the column.
    """
    path = Path(path) if path is not None else default_path()
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    reader = csv.DictReader(
        (line for line in lines if not line.startswith("#")), delimiter="\t", quoting=csv.QUOTE_NONE
    )
    missing = set(COLUMNS) - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected {COLUMNS}")
    return [_measurement(row, path) for row in reader]


def _measurement(row: dict[str, str], path: Path) -> Measurement:
    where = f"{path}: row {row.get('id')!r}"
    if row["split"] not in SPLITS:
        raise ValueError(f"{where}: split {row['split']!r} must be one of {SPLITS}")
    try:
        return Measurement(
            id=row["id"],
            split=row["split"],
            system=row["system"],
            topology=row["topology"],
            overrides=_overrides(row["overrides"]),
            gpus=int(row["gpus"]),
            collective=row["collective"],
            nbytes=parse_size(row["bytes"], what="bytes"),
            algorithm=None if row["algorithm"] == "default" else row["algorithm"],
            busbw_GBps=float(row["busbw_GBps"]),
            nccl=row["nccl"],
            source=row["source"],
            notes=row["quote_and_notes"],
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _overrides(text: str) -> tuple[tuple[str, object], ...]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        pairs.append((key.strip(), yaml.safe_load(value)))
    return tuple(pairs)


def topology_for(measurement: Measurement) -> Topology:
    """The measured system: its preset, with the row's YAML overrides applied.

    Raises:
        ValueError: overrides on a ``<preset>x<N>`` form (give ``nodes=`` instead) or on a key
            the preset does not have.
    """
    if not measurement.overrides:
        return load_topology(measurement.topology)
    path = PRESET_DIR / f"{measurement.topology}.yaml"
    if not path.is_file():
        raise ValueError(
            f"row {measurement.id!r}: overrides apply to a preset name, not "
            f"{measurement.topology!r}; give the node count as nodes=N"
        )
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    for key, value in measurement.overrides:
        *sections, leaf = key.split(".")
        node = document
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ValueError(f"row {measurement.id!r}: override {key!r} is not a preset key")
        node[leaf] = value
    described = ", ".join(f"{key}={value}" for key, value in measurement.overrides)
    return parse_topology_yaml(
        yaml.safe_dump(document, sort_keys=False),
        source=f"{measurement.topology} with {measurement.id}'s overrides",
        name=f"{measurement.topology} ({described})",
    )


def predict(measurement: Measurement) -> Estimate:
    """The cost model's estimate for the measured system, group, size and algorithm."""
    return estimate(
        measurement.collective,
        nbytes=measurement.nbytes,
        topology=topology_for(measurement),
        group_size=measurement.gpus,
        algorithm=measurement.algorithm,
    )


def validate(path: str | Path | None = None) -> list[Check]:
    """Every recorded measurement beside its prediction."""
    return [Check(m, predict(m)) for m in load_measurements(path)]


def render_checks(checks: list[Check]) -> str:
    """The table ``overlapkit estimate --validate`` prints (and docs/cost-model.md shows)."""
    header = (
        f"{'system (id)':<26} {'gpus':>4} {'collective':<14} {'size':>6} {'split':<8} "
        f"{'published':>9} {'predicted':>9} {'error':>7}  algorithm  source"
    )
    lines = [header, "-" * len(header)]
    for check in checks:
        measured, predicted = check.measurement, check.estimate
        flag = "" if check.within_tolerance else " *" if check.explained_miss else " !"
        lines.append(
            f"{measured.id:<26} {measured.gpus:>4} {measured.collective:<14} "
            f"{_size(measured.nbytes):>6} {measured.split:<8} {measured.busbw_GBps:>9.1f} "
            f"{predicted.busbw_GBps:>9.1f} {check.error:>+7.1%}{flag:<2} "
            f"{predicted.algorithm:<9}  {measured.source}"
        )
    worst = max(checks, key=lambda c: abs(c.error))
    inside = sum(c.within_tolerance for c in checks)
    explained = sum(c.explained_miss and not c.within_tolerance for c in checks)
    lines.append(
        f"{inside}/{len(checks)} within +-{TOLERANCE:.0%}, {explained} outside with the reason "
        f"in the row's notes (worst {worst.measurement.id}: {worst.error:+.1%}); busbw in GB/s "
        "as nccl-tests reports it; error = predicted / published - 1; '*' marks a row outside "
        "the tolerance whose notes explain why, '!' one that does not"
    )
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"{gib:g}G" if gib >= 1 else f"{nbytes / 2**20:g}M"
