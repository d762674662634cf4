"""What overlapkit-train runs: one table that the auto-planner's search and overlapkit-train's
checks before launch both read, so that the search proposes exactly what a run accepts.

A run is judged as a ``Job``: its ``TrainingLayout``, the pipeline ``Schedule`` that runs it and
the model's layers. ``WRAPPERS`` say which ``parallel._target_`` runs each sharding, ``SCHEDULES``
which pipeline schedules run and what each needs, ``REFUSED`` which combinations do not run; each
refusal is written once, in the search's words (``Refused.lacks``, for
``autoplan.framework.OVERLAPKIT_TRAIN``) and in train's (``Refused.config``, one line naming the
config keys). A new schedule or communication mode is a row here; both sides follow it. Why
each combination is refused: docs/training.md ("What overlapkit-train runs") and
docs/auto-planner.md ("What each framework runs").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from overlapkit.layout.training_layout import TrainingLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class Wrapper:
    """A ``parallel._target_`` overlapkit-train runs, and the shardings it runs."""

    target: str
    shardings: tuple[str, ...]
    """The ``TrainingLayout.sharding`` values it runs (``sharding_of`` tells which)."""
    runs_tp_and_ep: bool
    """Reduces tensor-parallel (DTensor) shards and expert parameters over their own groups."""


GRAD_BUCKETER = Wrapper(target="overlapkit.GradBucketer", shardings=("ddp",), runs_tp_and_ep=True)
DDP = Wrapper(target="overlapkit.ddp", shardings=("ddp",), runs_tp_and_ep=False)
FSDP = Wrapper(
    target="overlapkit.fsdp",
    shardings=("fsdp", "hsdp", "zero1", "zero2"),
    runs_tp_and_ep=False,
)
WRAPPERS = (GRAD_BUCKETER, DDP, FSDP)
TARGETS = tuple(w.target for w in WRAPPERS)
NEEDS_WRAPPER = {
    "tp": (
        tuple(w.target for w in WRAPPERS if w.runs_tp_and_ep),
        "it reduces the tensor-parallel (DTensor) shards over dp",
    ),
    "ep": (
        tuple(w.target for w in WRAPPERS if w.runs_tp_and_ep),
        "expert and dense parameters are reduced over different groups",
    ),
    "dp_shard": (
        tuple(w.target for w in WRAPPERS if "hsdp" in w.shardings),
        "HSDP is ok.fsdp on a (dp_replicate, dp_shard) mesh",
    ),
    "pp": (TARGETS, "the pipeline wraps each stage"),
}
"""``parallel.plan`` keys above 1 (or given) and the wrappers that run them, with why."""


def wrapper_of(target: str | None) -> Wrapper | None:
    """The row of ``parallel._target_`` (None: a wrapper the table does not know)."""
    return next((w for w in WRAPPERS if w.target == target), None)


def sharding_of(target: str | None, *, zero: object, dp_shard: int | None, dp: int) -> str | None:
    """The layout's sharding that ``parallel._target_`` runs (None: none the table knows).

    ``ok.fsdp`` is zero1 / zero2 with ``parallel.zero``, hsdp with ``dp_shard`` below ``dp``
    (with ``dp_shard == dp``, one replica: fsdp), fsdp otherwise.
    """
    wrapper = wrapper_of(target)
    if wrapper is None:
        return None
    if wrapper is not FSDP:
        return wrapper.shardings[0]
    if zero in (1, 2):
        return f"zero{zero}"
    return "hsdp" if dp_shard is not None and dp_shard < dp else "fsdp"


def wrapper_refusal(key: str, value: object, target: str | None) -> str | None:
    """Train's refusal of ``parallel.plan.<key>=value`` under ``target`` (None: it runs)."""
    targets, why = NEEDS_WRAPPER[key]
    if value in (None, 1) or target in targets:
        return None
    return (
        f"parallel.plan.{key}={value} needs parallel._target_ {' or '.join(targets)} ({why}), "
        f"got {target}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A ``torch.distributed.pipelining`` schedule (``parallel.plan.schedule``)."""

    name: str
    several_stages: bool
    """Runs ``virtual_stages > 1`` stages per rank (rank ``r`` holds ``r, r + pp, ...``, or a V:
    ``v_shape``); False: exactly one."""
    planned: bool
    """The auto-planner prices it (its bubble and memory) and proposes it."""
    micro_batches: Literal[
        "any", "at least pp", "multiple of pp", "multiple of its rounds", "at least 2 pp"
    ] = "any"
    """What it needs of a step's micro-batches (``train.grad_accum``): ``multiple of its
    rounds`` is ``ScheduleInterleavedZeroBubble``'s ``m % max(1, m // pp) == 0``, ``at least 2
    pp`` ``ScheduleDualPipeV``'s one per stage."""
    v_shape: bool = False
    """Places exactly two stages per rank in a V: rank ``r`` holds stages ``r`` and
    ``2 pp - 1 - r`` (the first and the last stage both on rank 0); False: loop, rank ``r``
    holds ``r, r + pp, ...``."""
    split_backward: bool = False
    """Splits a stage's backward into input- and weight-gradient steps (zero bubble)."""

    def stages_refusal(self, virtual_stages: int) -> str | None:
        """Train's refusal of ``virtual_stages`` stages per rank (None: it runs them)."""
        if self.v_shape and virtual_stages != 2:
            return (
                f"parallel.plan.schedule={self.name} places exactly 2 stages per rank in a V, "
                f"got parallel.plan.virtual_stages={virtual_stages}; set it to 2"
            )
        if self.several_stages == (virtual_stages > 1):
            return None
        want = "several stages" if self.several_stages else "one stage"
        others = [other.name for other in SCHEDULES if other.several_stages != self.several_stages]
        return (
            f"parallel.plan.schedule={self.name} runs {want} per rank, got "
            f"parallel.plan.virtual_stages={virtual_stages}; use {' or '.join(others)} for "
            f"{'one' if self.several_stages else 'several'}"
        )


SCHEDULES = (
    Schedule(name="1F1B", several_stages=False, planned=True, micro_batches="at least pp"),
    Schedule(name="GPipe", several_stages=False, planned=False),
    Schedule(
        name="Interleaved1F1B", several_stages=True, planned=True, micro_batches="multiple of pp"
    ),
    Schedule(name="LoopedBFS", several_stages=True, planned=False),
    Schedule(
        name="InterleavedZeroBubble",
        several_stages=True,
        planned=True,
        micro_batches="multiple of its rounds",
        split_backward=True,
    ),
    Schedule(
        name="ZBVZeroBubble", several_stages=True, planned=True, v_shape=True, split_backward=True
    ),
    Schedule(
        name="DualPipeV",
        several_stages=True,
        planned=True,
        micro_batches="at least 2 pp",
        v_shape=True,
        split_backward=True,
    ),
)
"""Every schedule ``parallel.plan.schedule`` names. ``planned``: the ones the search proposes
(1F1B with one stage per rank; interleaved 1F1B and the zero-bubble schedules with several,
priced by ``overlapkit.autoplan.pipeline_schedule``); GPipe and LoopedBFS run but are not
priced (GPipe keeps every micro-batch's activations)."""


def schedule_named(name: str) -> Schedule:
    """The row of ``name`` (case-insensitive, as torch's lookup).

    Raises:
        ValueError: not one of ``SCHEDULES``, naming ``parallel.plan.schedule`` and the valid.
    """
    for schedule in SCHEDULES:
        if str(name).lower() == schedule.name.lower():
            return schedule
    raise ValueError(
        f"parallel.plan.schedule={name!r} is not a torch.distributed.pipelining schedule; "
        f"valid: {', '.join(schedule.name for schedule in SCHEDULES)}"
    )


def planned_schedule(virtual_stages: int) -> Schedule:
    """The schedule the planner prices for ``virtual_stages`` when a layout names none: 1F1B,
    or interleaved 1F1B (the first planned one with several stages)."""
    several = virtual_stages > 1
    return next(s for s in SCHEDULES if s.planned and s.several_stages == several)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What the table judges: a layout, the schedule that runs it, the model's layers."""

    layout: TrainingLayout
    schedule: Schedule
    layers: int | None = None
    """The model's layers (None: the stage split is not checked)."""
    shard_group: int | None = None
    """``ok.fsdp``'s shard group on a 2-D (dp_replicate, dp_shard) mesh: the layout's
    ``dp_shard``, or train's ``parallel.plan.dp_shard`` under another ``ok.fsdp`` sharding."""

    @classmethod
    def planned(cls, layout: TrainingLayout, layers: int | None = None) -> Job:
        """``layout`` as the search proposes it: on its own schedule (``layout.schedule``), or
        on the one planned for its ``virtual_stages``."""
        named = layout.schedule
        schedule = schedule_named(named) if named else planned_schedule(layout.virtual_stages)
        return cls(
            layout=layout,
            schedule=schedule,
            layers=layers,
            shard_group=layout.dp_shard,
        )

    def fields(self) -> dict[str, object]:
        """The names ``Refused``'s messages format: the layout's fields and the job's."""
        layout = self.layout
        spread = [f"{k}={v}" for k, v in (("cp", layout.cp), ("ep", layout.ep)) if v > 1]
        zero = layout.sharding.startswith("zero")
        return asdict(layout) | {
            "schedule": self.schedule.name,
            "layers": self.layers,
            "chunks": layout.pipeline_chunks,
            "rounds": _rounds(layout.num_micro_batches, layout.pp),
            "shard_group": self.shard_group,
            "spread": " and ".join(spread),
            "under": f"FSDP ({layout.sharding})" if zero else "FSDP",
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """A combination a framework does not run: when, and in whose words."""

    when: Callable[[Job], bool]
    lacks: str
    """What it lacks, in the search's words (``str.format`` of ``Job.fields``)."""
    config: str = ""
    """overlapkit-train's one-line refusal naming the config keys (same fields)."""


def _no_wrapper_runs_tp_and_ep(job: Job) -> bool:
    """No wrapper of the layout's sharding runs tp and ep (the ``ok.fsdp`` shardings)."""
    return not any(w.runs_tp_and_ep for w in WRAPPERS if job.layout.sharding in w.shardings)


def _micro_batches_short(job: Job) -> bool:
    need, layout = job.schedule.micro_batches, job.layout
    m = layout.num_micro_batches
    if layout.pp == 1 or need == "any":
        return False
    if need == "at least pp":
        return m < layout.pp
    if need == "at least 2 pp":
        return m < 2 * layout.pp
    if need == "multiple of its rounds":
        return m % _rounds(m, layout.pp) != 0
    return m % layout.pp != 0


def _rounds(micro_batches: int, pp: int) -> int:
    """``ScheduleInterleavedZeroBubble``'s rounds of a step: ``max(1, m // pp)``."""
    return max(1, micro_batches // pp)


_USE_ONE = "; use one of them"
REFUSED = (
    Refused(
        when=lambda job: job.layout.tp > 1 and job.layout.ep > 1,
        lacks="tensor and expert parallelism together",
        config="parallel.plan.tp ({tp}) with parallel.plan.ep ({ep}): tensor-parallel experts "
        "are not supported by the training loop" + _USE_ONE,
    ),
    Refused(
        when=lambda job: job.layout.tp > 1 and _no_wrapper_runs_tp_and_ep(job),
        lacks="tensor parallelism under {under}",
        config="parallel.plan.tp={tp} needs parallel._target_ overlapkit.GradBucketer ("
        + NEEDS_WRAPPER["tp"][1]
        + "), got overlapkit.fsdp",
    ),
    Refused(
        when=lambda job: job.layout.ep > 1 and _no_wrapper_runs_tp_and_ep(job),
        lacks="expert parallelism under {under}",
        config="parallel.plan.ep={ep} needs parallel._target_ overlapkit.GradBucketer ("
        + NEEDS_WRAPPER["ep"][1]
        + "), got overlapkit.fsdp",
    ),
    Refused(
        when=lambda job: job.layout.pp > 1 and job.layout.ep > 1,
        lacks="pipeline with expert parallelism",
        config="parallel.plan.pp={pp} with parallel.plan.ep={ep}: expert parallelism inside "
        "pipeline stages is not supported" + _USE_ONE,
    ),
    Refused(
        when=lambda job: job.layout.pp > 1 and job.layout.cp > 1,
        lacks="pipeline with context parallelism",
        config="parallel.plan.pp={pp} with parallel.plan.cp={cp}: the pipeline's stages pass "
        "whole sequences, not a context-parallel shard" + _USE_ONE,
    ),
    Refused(
        when=lambda job: job.layout.pp > 1 and job.layout.sharding == "zero2",
        lacks="zero2 under a pipeline",
        config="parallel.zero=2 (ZeRO-2) with parallel.plan.pp={pp}: torch's PipelineStage "
        "defers FSDP2's gradient reduction to after the stage's last micro-batch, so the "
        "reduce-scatter of every micro-batch ZeRO-2 promises cannot happen; use parallel=zero1, "
        "which has the traffic a pipeline gives",
    ),
    Refused(
        when=lambda job: job.layout.cp > 1 and job.layout.ep > 1,
        lacks="context with expert parallelism",
        config="parallel.plan.cp ({cp}) with parallel.plan.ep ({ep}): the experts' reduction "
        "groups do not include cp in the training loop" + _USE_ONE,
    ),
    Refused(
        when=lambda job: job.layout.cp > 1 and job.shard_group is not None,
        lacks="cp with hsdp",
        config="parallel.plan.cp ({cp}) with parallel.plan.dp_shard ({shard_group}): HSDP would "
        "shard over dp_shard x cp, a 2-D mesh torch builds only by slicing a flattened axis from "
        "the root mesh (deprecated); use ok.fsdp without dp_shard (it shards over dp x cp)",
    ),
    Refused(
        when=lambda job: job.layers is not None and job.layers % job.layout.pipeline_chunks != 0,
        lacks="{layers} layers in {chunks} pipeline chunks (unequal stages)",
        config="parallel.plan.pp x parallel.plan.virtual_stages = {pp} x {virtual_stages} = "
        "{chunks} stages must divide model.config.n_layer ({layers}) for "
        "parallel.plan.schedule={schedule}",
    ),
    Refused(
        when=lambda job: _micro_batches_short(job) and job.schedule.micro_batches == "at least pp",
        lacks="a pipeline of {pp} stages with {num_micro_batches} micro-batches per step (fewer "
        "than its stages)",
        config="train.grad_accum={num_micro_batches} micro-batches per step is fewer than the "
        "{pp} stages parallel.plan.schedule={schedule} keeps in flight; set train.grad_accum "
        ">= {pp}",
    ),
    Refused(
        when=lambda job: (
            _micro_batches_short(job) and job.schedule.micro_batches == "at least 2 pp"
        ),
        lacks="a {schedule} pipeline of {pp} ranks with {num_micro_batches} micro-batches per "
        "step (fewer than its 2 x {pp} stages)",
        config="train.grad_accum={num_micro_batches} micro-batches per step is fewer than the "
        "2 x {pp} stages parallel.plan.schedule={schedule} runs (one each); set train.grad_accum "
        ">= {chunks}",
    ),
    Refused(
        when=lambda job: (
            _micro_batches_short(job) and job.schedule.micro_batches == "multiple of its rounds"
        ),
        lacks="a {schedule} pipeline of {pp} stages with {num_micro_batches} micro-batches per "
        "step (not a multiple of its {rounds} rounds)",
        config="train.grad_accum={num_micro_batches} micro-batches per step are not a multiple "
        "of the {rounds} rounds (max(1, grad_accum // parallel.plan.pp)) "
        "parallel.plan.schedule={schedule} runs them in; use a multiple of {pp}",
    ),
    Refused(
        when=lambda job: (
            _micro_batches_short(job) and job.schedule.micro_batches == "multiple of pp"
        ),
        lacks="a {schedule} pipeline of {pp} stages with {num_micro_batches} micro-batches per "
        "step (not a multiple of its stages)",
        config="train.grad_accum={num_micro_batches} micro-batches per step are not a multiple of "
        "parallel.plan.pp={pp}, which parallel.plan.schedule={schedule} runs in rounds of pp "
        "(as Megatron-LM's interleaved schedule, and as the planner prices it); use a multiple "
        "of {pp}",
    ),
)
"""What overlapkit-train does not run, first match first (``autoplan.framework.OVERLAPKIT_TRAIN``
reads every row; ``train.parallel.run_layout.check_layout`` raises the first's ``config``)."""


def lacks(job: Job, rows: tuple[Refused, ...] = REFUSED) -> list[str]:
    """What of ``job`` ``rows`` refuse, in the search's words (empty: it runs)."""
    fields = job.fields()
    return [row.lacks.format(**fields) for row in rows if row.when(job)]


def config_refusal(job: Job) -> str | None:
    """overlapkit-train's one-line refusal of ``job`` naming the config keys (None: it runs)."""
    row = next((row for row in REFUSED if row.when(job)), None)
    return None if row is None else row.config.format(**job.fields())
