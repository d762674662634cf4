"""The auto-planner checked against published training runs (``data/published_runs.tsv``).

Each row is a run a paper or a framework's benchmark page published: the topology it ran on,
the model, the layout it used and the throughput it measured, with the quoted figures. For each
``validate`` evaluates the published layout with its sizes fixed (what the source leaves
unsaid, such as micro-batch size or interleaving, is searched), checks that it is predicted to
fit, and compares the predicted tokens per second per GPU with the published one (converted
from the source's own unit: ``metric``). It also runs the free search on the same topology and
batch and reports how much faster its top choice is predicted to be.

``overlapkit plan --auto --validate`` prints the table; ``tests/test_published_runs.py`` holds
the model to ``TOLERANCE``.

**Fit and held-out rows** (``split``, as ``cost/data/published_busbw.tsv`` has it): only ``fit``
rows set ``LAYER_OVER_MATMUL`` (``fit_layer_over_matmul``); ``held_out`` rows only check it.
A row whose miss is explained (``expected`` starting ``miss:``) is held out: its error comes
from what the layer factor does not describe (a GPU below the preset's power, a pipeline
schedule or an overlap the model lacks), and fitting the factor to it would move every other
row. Of the rows expected within, each source's are held out and fitted in turn from the
smallest model up, so the smallest of each source is held out: what brings small models in
is then the model's terms, not the fit.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from overlapkit.autoplan.candidate import Candidate
from overlapkit.autoplan.compute import LAYER_OVER_MATMUL
from overlapkit.autoplan.memory import PRECISIONS
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.search import search
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings, with_memory
from overlapkit.topology.loading import load_topology

TOLERANCE = 0.15
SPLITS = ("fit", "held_out")
FIXED_FIELDS = (
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "micro_batch",
    "virtual_stages",
    "recompute",
    "sharding",
)


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One row of ``data/published_runs.tsv``."""

    name: str
    source: str
    quote: str
    topology: str
    gpu_memory_gb: float
    model: str
    seq_len: int
    global_batch: int
    fixed: dict
    precision: str
    flash_attention: bool
    ep_overlap: float
    metric: str
    published: float
    expected: str = "within"
    """``within`` (held to ``TOLERANCE``) or ``miss: ...`` with the evidence for the difference
    (the error itself is printed beside it, as computed)."""
    split: str = "held_out"
    """``fit`` (sets ``LAYER_OVER_MATMUL``) or ``held_out`` (only checks it); see module doc."""

    @property
    def explained_miss(self) -> bool:
        return self.expected.startswith("miss")

    def model_spec(self) -> ModelSpec:
        """The built-in model, or a Megatron GPT given as ``gpt:layers=..,hidden=..,heads=..``
        (``models.GPT_SPEC``, learned positions for the row's sequence length)."""
        return load_model(self.model, seq_len=self.seq_len)

    def published_tokens_per_s_per_gpu(self, model: ModelSpec) -> float:
        """The published throughput in tokens per second per GPU (see module doc)."""
        gpus = load_topology(self.topology).world_size
        s = self.seq_len
        match self.metric:
            case "tokens_per_s_per_gpu":
                return self.published
            case "iteration_s":
                return self.global_batch * s / (self.published * gpus)
            case "model_tflops_per_gpu":
                return self.published * 1e12 / model.model_flops_per_token(s)
            case "megatron_hardware_tflops":
                h, layers, vocab = model.hidden, model.layers, model.vocab_size
                flops = (
                    96
                    * self.global_batch
                    * s
                    * layers
                    * h**2
                    * (1 + s / (6 * h) + vocab / (16 * layers * h))
                )
                iteration = flops / (gpus * self.published * 1e12)
                return self.global_batch * s / (iteration * gpus)
        raise ValueError(f"{self.name}: unknown metric {self.metric!r}")

    @property
    def fits_the_layer_factor(self) -> bool:
        """Whether ``fit_layer_over_matmul`` uses this row (``split`` is ``fit``)."""
        return self.split == "fit"

    def settings(self, *, layer_over_matmul: float = LAYER_OVER_MATMUL) -> SearchSettings:
        return SearchSettings(
            precision=PRECISIONS[self.precision],
            flash_attention=self.flash_attention,
            ep_overlap=self.ep_overlap,
            layer_over_matmul=layer_over_matmul,
        )


@dataclass(frozen=True, slots=True)
class RunCheck:
    """A published run against the planner's prediction for its layout."""

    run: PublishedRun
    published_tps: float
    predicted: Candidate
    free_best: Candidate | None

    @property
    def error(self) -> float:
        return self.predicted.tokens_per_s_per_gpu / self.published_tps - 1

    @property
    def within_tolerance(self) -> bool:
        return abs(self.error) <= TOLERANCE and self.predicted.fits

    @property
    def free_gain(self) -> float | None:
        """How much faster the free search's top choice is predicted to be (a ratio)."""
        if self.free_best is None:
            return None
        return self.free_best.tokens_per_s_per_gpu / self.predicted.tokens_per_s_per_gpu

    def to_dict(self) -> dict:
        return {
            "name": self.run.name,
            "split": self.run.split,
            "source": self.run.source,
            "quote": self.run.quote,
            "published_tokens_per_s_per_gpu": self.published_tps,
            "predicted_tokens_per_s_per_gpu": self.predicted.tokens_per_s_per_gpu,
            "error": self.error,
            "fits": self.predicted.fits,
            "memory_gb_per_gpu": self.predicted.memory.total / 1e9,
            "layout": self.predicted.layout.describe(),
            "within_tolerance": self.within_tolerance,
            "expected": self.run.expected,
            "free_search_best": None
            if self.free_best is None
            else self.free_best.layout.describe(),
            "free_search_gain": self.free_gain,
        }


def _cell(row: dict, key: str):
    value = row[key].strip()
    if value == "":
        return None
    return value if key in ("recompute", "sharding") else int(value)


def published_runs(path: str | Path | None = None) -> list[PublishedRun]:
    """Every row of ``data/published_runs.tsv`` (or of the table at ``path``).

    Raises:
        ValueError: a row whose ``split`` is not one of ``SPLITS``, naming the row.
    """
    if path is None:
        table = resources.files("overlapkit.autoplan").joinpath("data/published_runs.tsv")
        text = table.read_text()
    else:
        text = Path(path).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    out = []
    for row in csv.DictReader(io.StringIO("\n".join(lines)), delimiter="\t"):
        if row["split"] not in SPLITS:
            raise ValueError(f"{row['name']}: split {row['split']!r} must be one of {SPLITS}")
        fixed = {k: _cell(row, k) for k in FIXED_FIELDS if _cell(row, k) is not None}
        out.append(
            PublishedRun(
                name=row["name"],
                source=row["source"],
                quote=row["quote"],
                topology=row["topology"],
                gpu_memory_gb=float(row["gpu_memory_gb"]),
                model=row["model"],
                seq_len=int(row["seq_len"]),
                global_batch=int(row["global_batch"]),
                fixed=fixed,
                precision=row["precision"],
                flash_attention=row["attention"] == "flash",
                ep_overlap=float(row["ep_overlap"]),
                metric=row["metric"],
                published=float(row["published"]),
                expected=row["expected"],
                split=row["split"],
            )
        )
    return out


def check_run(
    run: PublishedRun, *, free_search: bool = True, layer_over_matmul: float = LAYER_OVER_MATMUL
) -> RunCheck:
    """Evaluate ``run``'s layout (and, with ``free_search``, the planner's own choice)."""
    topology = with_memory(load_topology(run.topology), run.gpu_memory_gb)
    model = run.model_spec()
    settings = run.settings(layer_over_matmul=layer_over_matmul)
    kwargs = dict(global_batch=run.global_batch, seq_len=run.seq_len, settings=settings)
    pinned = dict(run.fixed)
    if pinned.get("recompute") == "full":
        pinned["recompute_layers"] = "all"  # the sources recompute every layer
    fixed = search(topology, model, fixed=pinned, candidates=1, **kwargs).best
    free = None
    if free_search:
        try:
            free = search(topology, model, candidates=1, **kwargs).best
        except PlanSearchError:
            free = None
    return RunCheck(run, run.published_tokens_per_s_per_gpu(model), fixed, free)


def layer_factor_loss(runs: list[PublishedRun], layer_over_matmul: float) -> float:
    """Sum of squared log errors of ``runs``' published layouts at ``layer_over_matmul``."""
    return sum(
        math.log1p(check_run(run, free_search=False, layer_over_matmul=layer_over_matmul).error)
        ** 2
        for run in runs
    )


def fit_layer_over_matmul(
    runs: list[PublishedRun] | None = None, *, low: float = 0.6, high: float = 0.95
) -> float:
    """``LAYER_OVER_MATMUL`` fitted: least squares on the log error of the published layouts.

    Only the ``fit`` rows count (a held-out row does not move the factor). Golden-section
    search to 0.001 on ``[low, high]`` (the loss is unimodal there: every predicted throughput
    rises with the factor).
    """
    runs = [r for r in (runs or published_runs()) if r.fits_the_layer_factor]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = layer_factor_loss(runs, c), layer_factor_loss(runs, d)
    while b - a > 1e-3:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = layer_factor_loss(runs, c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = layer_factor_loss(runs, d)
    return (a + b) / 2


def validate(*, free_search: bool = True) -> list[RunCheck]:
    """Check every published run (see module doc)."""
    return [check_run(run, free_search=free_search) for run in published_runs()]


def split_summary(checks: list[RunCheck]) -> list[str]:
    """One line per group of rows (fit; held out, expected within; held out, explained miss):
    how many, and their mean absolute and largest error."""
    groups = {
        "fit": [c for c in checks if c.run.split == "fit"],
        "held out, expected within": [
            c for c in checks if c.run.split == "held_out" and not c.run.explained_miss
        ],
        "held out, explained miss": [c for c in checks if c.run.explained_miss],
    }
    lines = []
    for label, group in groups.items():
        if not group:
            continue
        errors = [abs(c.error) for c in group]
        worst = max(group, key=lambda c: abs(c.error))
        inside = sum(c.within_tolerance for c in group)
        lines.append(
            f"{label}: {len(group)} rows, {inside} within ±{TOLERANCE:.0%}, mean |error| "
            f"{sum(errors) / len(errors):.1%}, largest {worst.error:+.1%} ({worst.run.name})"
        )
    return lines


def render_run_checks(checks: list[RunCheck]) -> str:
    """The ``overlapkit plan --auto --validate`` table."""
    header = (
        f"{'run':<34} {'split':<8} {'published':>9} {'predicted':>9} {'error':>7} {'fits':>4} "
        f"{'GB':>5}  {'free best (gain)':<12}"
    )
    lines = ["tokens/s per GPU: published (the source's figure, converted) vs predicted", header]
    for c in checks:
        gain = "" if c.free_gain is None else f"{c.free_gain:.2f}x {c.free_best.layout.describe()}"
        lines.append(
            f"{c.run.name:<34} {c.run.split:<8} {c.published_tps:>9.1f} "
            f"{c.predicted.tokens_per_s_per_gpu:>9.1f} {c.error * 100:>+6.1f}% "
            f"{'yes' if c.predicted.fits else 'NO':>4} "
            f"{c.predicted.memory.total / 1e9:>5.1f}  {gain}"
        )
    inside = sum(c.within_tolerance for c in checks)
    lines.append(f"{inside} of {len(checks)} within ±{TOLERANCE:.0%} and predicted to fit.")
    lines += split_summary(checks)
    lines.append("layouts evaluated (the published sizes; what the source leaves out, searched):")
    lines += [f"  {c.run.name}: {c.predicted.layout.describe()}" for c in checks]
    misses = [c for c in checks if not c.within_tolerance]
    if misses:
        lines.append("outside ±15 %:")
        lines += [
            f"  {c.run.name} ({c.error:+.1%}): {c.run.expected.removeprefix('miss: ')}"
            for c in misses
        ]
    return "\n".join(lines)
