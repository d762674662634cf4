"""``ok.plan``: place the sizes given, or (``auto=True``) choose them for a model and a batch.

``ok.plan(topo, tp=8, pp=2)`` places the sizes it is given (``planner.placement.plan``).
``ok.plan(topo, model="llama3-8b", global_batch=512, seq_len=8192, auto=True)`` runs the
auto-planner (``autoplan.search``): every layout of the model on the topology, pruned by memory,
ranked by predicted step time; the best is placed on the topology's rank grid and returned as a
``Placement`` whose ``training`` holds the whole choice (micro-batching, interleaving,
recomputation, sharding) and whose ``workload`` the model and micro-batching, so
``plan.device_mesh()`` and ``plan.explain()`` work as for a manual plan. Under ``auto`` a choice
left unset is free; one that is given (a size, ``micro_batch``, ``virtual_stages``,
``recompute`` / ``recompute_layers``, ``sharding`` / ``dp_shard``: ``autoplan.pins``) constrains
the search. ``framework=`` (a name or a ``Framework``) says what runs the layouts: only what it
runs is searched, priced as it runs it; ``attention="softmax"`` prices attention without flash.

Sizes follow ``ok.plan``'s convention: ``world = pp x dp x ep x cp x tp``; Megatron-LM's and
torchtitan's data-parallel size is ``dp x ep`` (``overlapkit.layout``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from overlapkit.autoplan.candidate import Candidate, SearchResult
from overlapkit.autoplan.framework import Framework
from overlapkit.autoplan.memory import PRECISIONS, Precision
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.pins import pins_from
from overlapkit.autoplan.search import Pins, search
from overlapkit.autoplan.settings import SearchSettings, flash_attention_of, with_memory
from overlapkit.layout import CHOICES, PartialLayout, TrainingLayout
from overlapkit.planner.placement import Placement
from overlapkit.planner.placement import plan as place
from overlapkit.planner.traffic import Workload
from overlapkit.topology.model import Topology


@dataclass(frozen=True, slots=True)
class AutoPlan:
    """The auto-planner's answer: the ranked candidates and the best one placed."""

    model: ModelSpec
    topology: Topology
    result: SearchResult
    placement: Placement
    seq_len: int
    global_batch: int
    settings: SearchSettings
    """What the search assumed (precision, achievable fraction, framework)."""
    model_source: str | None = None
    """What ``model`` was loaded from (a built-in name, a config.json path, a ``gpt:`` shape);
    None for a ``ModelSpec`` passed in."""
    gpu_memory_gb: float | None = None
    """The GPU memory the caller set (None: the topology's)."""

    @property
    def best(self) -> Candidate:
        return self.result.best


def workload_of(model: ModelSpec, layout: TrainingLayout, seq_len: int) -> Workload:
    """The ``Workload`` a placement explains for ``model`` trained as ``layout``."""
    return Workload(
        params=float(model.params),
        layers=model.layers,
        hidden=model.hidden,
        seq_len=seq_len,
        micro_batch=layout.micro_batch,
        microbatches=layout.num_micro_batches,
        topk=max(1, model.topk),
        expert_fraction=model.expert_params / model.params if model.is_moe else 0.0,
    )


def place_layout(
    topology: Topology, model: ModelSpec, layout: TrainingLayout, seq_len: int
) -> Placement:
    """Lay ``layout``'s sizes onto ``topology``'s rank grid (``ok.plan``), carrying it along."""
    placement = place(
        topology,
        **PartialLayout.of(layout).placement_sizes(),
        allow_split=True,
        workload=workload_of(model, layout, seq_len),
    )
    return dataclasses.replace(placement, training=layout)


def auto_plan(
    topology: Topology,
    model: str | Path | ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    fixed: Pins = None,
    precision: str | Precision | None = None,
    gpu_memory_gb: float | None = None,
    candidates: int = 5,
    settings: SearchSettings | None = None,
    attention: str | None = None,
    framework: str | Framework | None = None,
    achievable: float | None = None,
) -> AutoPlan:
    """Search the layouts of ``model`` on ``topology`` and place the best (see module doc).

    ``fixed``: the pins (a ``PartialLayout``, or ``ok.plan``'s keywords as a mapping).
    ``precision`` (``bf16``, ``fp8``, ...), ``attention`` (``flash``, ``softmax``),
    ``framework`` (a name in ``autoplan.framework.FRAMEWORKS`` or a ``Framework``) and
    ``achievable`` (fraction of the dense peak) replace those of ``settings`` when given.

    Raises:
        PlanSearchError: no layout fits, the batch divides no layout, fixed sizes that do not
            divide the world, a pin the framework does not run (a ValueError naming it).
        ValueError / FileNotFoundError: a bad model name or config.json, a bad setting.
    """
    spec = model if isinstance(model, ModelSpec) else load_model(model, seq_len=seq_len)
    changes: dict = {}
    if precision is not None:
        if isinstance(precision, str):
            if precision not in PRECISIONS:
                raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISIONS)}")
            precision = PRECISIONS[precision]
        changes["precision"] = precision
    if attention is not None:
        changes["flash_attention"] = flash_attention_of(attention)
    if framework is not None:
        changes["framework"] = framework
    if achievable is not None:
        if isinstance(achievable, bool) or not 0 < achievable <= 1:
            raise ValueError(f"--achievable must be in (0, 1], got {achievable!r}")
        changes["achievable"] = achievable
    topology = with_memory(topology, gpu_memory_gb)
    settings = dataclasses.replace(settings or SearchSettings(), **changes)
    result = search(
        topology,
        spec,
        global_batch=global_batch,
        seq_len=seq_len,
        fixed=fixed,
        settings=settings,
        candidates=candidates,
    )
    placement = place_layout(topology, spec, result.best.layout, seq_len)
    source = None if isinstance(model, ModelSpec) else str(model)
    return AutoPlan(
        spec,
        topology,
        result,
        placement,
        seq_len,
        global_batch,
        settings,
        model_source=source,
        gpu_memory_gb=gpu_memory_gb,
    )


def plan(
    topology: Topology,
    tp: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    *,
    dp_shard: int | None = None,
    order=None,
    allow_split: bool = False,
    workload: Workload | None = None,
    model: str | Path | ModelSpec | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    auto: bool = False,
    **auto_options,
) -> Placement:
    """Place parallel sizes on ``topology``, or choose them for a model (``auto=True``).

    Without ``auto`` this is ``planner.placement.plan`` (unset sizes are 1, ``dp`` what is
    left). With ``auto``, ``model`` (a built-in name, a config.json, a ``gpt:`` shape or a
    ``ModelSpec``), ``global_batch`` (sequences per step) and ``seq_len`` are required; unset
    choices are searched, set ones pinned: the sizes, ``dp_shard`` and, in ``auto_options``,
    ``micro_batch``, ``virtual_stages``, ``recompute`` (``none``, ``selective``, ``full``,
    ``full:K``, ``full:all``), ``recompute_layers`` (K layers of each pipeline stage, or
    ``"all"``) and ``sharding`` (``autoplan.pins``). The other ``auto_options`` go to
    ``auto_plan``: ``framework``, ``attention``, ``precision``, ``gpu_memory_gb``,
    ``achievable``, ``candidates``, ``settings``.

    Returns:
        Placement: with ``auto``, the best layout's, ``training`` set to it.

    Raises:
        ValueError: ``auto`` without model / global_batch / seq_len, or the search's errors.

    Example:
        >>> plan = ok.plan(topo, model="llama3-8b", global_batch=512, seq_len=8192, auto=True)
        >>> plan.training.micro_batch, plan.training.num_micro_batches
        >>> mesh = plan.device_mesh()
    """
    sizes = {"tp": tp, "ep": ep, "cp": cp, "pp": pp, "dp": dp}
    if not auto:
        if model is not None or global_batch is not None or auto_options:
            raise ValueError(
                "model=, global_batch= and the search options go with auto=True "
                "(ok.plan(topo, model=..., global_batch=..., seq_len=..., auto=True))"
            )
        return place(
            topology,
            tp=1 if tp is None else tp,
            ep=1 if ep is None else ep,
            cp=1 if cp is None else cp,
            pp=1 if pp is None else pp,
            dp=-1 if dp is None else dp,
            dp_shard=dp_shard,
            order=order,
            allow_split=allow_split,
            workload=workload,
        )
    missing = [
        k
        for k, v in (("model", model), ("global_batch", global_batch), ("seq_len", seq_len))
        if v is None
    ]
    if missing:
        raise ValueError(f"auto=True needs {', '.join(missing)}")
    if order is not None or workload is not None:
        raise ValueError("order= and workload= are chosen by the planner under auto=True")
    given = sizes | {"dp": None if dp == -1 else dp, "dp_shard": dp_shard}
    given |= {key: auto_options.pop(key) for key in CHOICES if key in auto_options}
    return auto_plan(
        topology,
        model,
        global_batch=global_batch,
        seq_len=seq_len,
        fixed=pins_from(given),
        **auto_options,
    ).placement
