"""The hand-off of a layout to torchtitan: the ``torchtitan.train`` arguments that run it, and
what of it torchtitan cannot express.

``torchtitan_run`` gives the arguments (``--module``/``--config`` of a registered config where
one matches the model's shape, then every choice of the plan as ``--section.key value``
overrides, so that the named config's own choices never leak in) and warnings for what
torchtitan would refuse at start-up or runs otherwise than planned. ``degrees`` and
``torchtitan_stage_split`` convert the planner's sizes and pipeline stages to torchtitan's
conventions. Everything here is checked against torchtitan ``TORCHTITAN_VERSION`` itself
(``tests/test_torchtitan_handoff.py``); what each argument carries and why:
docs/auto-planner.md, "Handing the plan to torchtitan".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from overlapkit.autoplan.memory import layers_per_stage
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pipeline_schedule import schedule_of
from overlapkit.layout import TrainingLayout
from overlapkit.planner.placement import Placement

TORCHTITAN_VERSION = "0.3.0"
"""The torchtitan release these arguments were checked against (pyproject's extra pins it)."""
TORCHTITAN_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's mesh axes, outermost first (``ParallelDims.build_mesh``)."""
STAGE_WEIGHTS = ((1, 1), (1, 0), (0, 1), (0, 0))
"""(embedding, head) weights tried for the stage split, torchtitan's default first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisteredConfig:
    """A ``config_registry`` function of torchtitan and the model shape it trains."""

    module: str
    config: str
    layers: int
    hidden: int
    heads: int
    vocab_size: int
    experts: int = 0
    precision: str = "bf16"
    """What the named config trains in (its model converters)."""
    trains: str = ""
    """What else it sets that the plan does not price, in words."""

    def matches(self, model: ModelSpec) -> bool:
        shape = (model.layers, model.hidden, model.heads, model.vocab_size, model.experts)
        return shape == (self.layers, self.hidden, self.heads, self.vocab_size, self.experts)


REGISTERED = (
    RegisteredConfig(
        module="llama3", config="llama3_8b", layers=32, hidden=4096, heads=32, vocab_size=128256
    ),
    RegisteredConfig(
        module="llama3", config="llama3_70b", layers=80, hidden=8192, heads=64, vocab_size=128256
    ),
    RegisteredConfig(
        module="llama3",
        config="llama3_405b",
        layers=126,
        hidden=16384,
        heads=128,
        vocab_size=128256,
        precision="fp8",
        trains="float8 linears (torchao; its config refuses to build without an SM89+ GPU), "
        "torch.compile and async TP",
    ),
    RegisteredConfig(
        module="deepseek_v3",
        config="deepseek_v3_16b",
        layers=27,
        hidden=2048,
        heads=16,
        vocab_size=102400,
        experts=64,
    ),
    RegisteredConfig(
        module="deepseek_v3",
        config="deepseek_v3_671b",
        layers=61,
        hidden=7168,
        heads=128,
        vocab_size=129280,
        experts=256,
    ),
)
"""The registered configs of torchtitan 0.3.0 a planner model can match (by shape; its qwen3
configs have no ``ModelSpec`` family here)."""


@dataclass(frozen=True, slots=True)
class StageSplit:
    """torchtitan's split of the layers into pipeline stages (``torchtitan_stage_split``)."""

    layers_per_stage: int | None
    """``pipeline_parallel_layers_per_stage``; None: no value gives the stage count, the
    split goes as ``module_fqns_per_model_part`` (``module_names``)."""
    first_weight: int
    """``pipeline_parallel_first_stage_less_layers``: the embedding counted as layers."""
    last_weight: int
    """``pipeline_parallel_last_stage_less_layers``: the final norm and head."""
    stage_layers: tuple[int, ...]
    """Transformer layers of each stage, in stage order."""

    def rank_layers(self, pp: int) -> list[int]:
        """Layers each pipeline rank holds (stage ``s`` runs on rank ``s % pp``)."""
        return [sum(self.stage_layers[r::pp]) for r in range(pp)]

    def module_names(self) -> list[str]:
        """Each stage's modules as torchtitan names them, comma-separated: the embedding in
        the first, the final norm and the head in the last."""
        out, first = [], 0
        for index, count in enumerate(self.stage_layers):
            names = [f"layers.{i}" for i in range(first, first + count)]
            if index == 0:
                names.insert(0, "tok_embeddings")
            if index == len(self.stage_layers) - 1:
                names += ["norm", "lm_head"]
            out.append(",".join(names))
            first += count
        return out


def torchtitan_stage_split(layers: int, stages: int) -> StageSplit | None:
    """How torchtitan 0.3.0 splits ``layers`` into ``stages`` stages, or None when it cannot.

    ``pipeline.pipeline_parallel._get_pipeline_metadata`` makes
    ``ceil((layers + first + last) / layers_per_stage)`` stages, and
    ``_generate_llm_fqn_per_model_part`` hands them ``(layers + first + last) // stages``
    effective layers each (the first ``remainder`` one more), the first stage ``first`` fewer
    transformer layers, the last ``last`` fewer, and refuses a weight above the per-stage count.
    The default weights (1, 1) are tried first; where no ``layers_per_stage`` makes exactly
    ``stages`` stages (80 layers in 24), the same rule's split is named module by module.
    """
    fallback = None
    for first, last in STAGE_WEIGHTS:
        effective = layers + first + last
        per_stage = math.ceil(effective / stages)
        counts = _distribute(layers, stages, first, last)
        if counts is not None and math.ceil(effective / per_stage) == stages:
            return StageSplit(per_stage, first, last, counts)
        if counts is not None and fallback is None:
            fallback = StageSplit(None, first, last, counts)
    return fallback


def _distribute(layers: int, stages: int, first: int, last: int) -> tuple[int, ...] | None:
    """Transformer layers per stage as torchtitan hands them out (None: it refuses)."""
    if stages == 1:
        return (layers,)
    effective = layers + first + last
    base, extra = divmod(effective, stages)
    if stages > effective or base < 1 or first > base or last > base:
        return None
    counts, left = [], layers
    for index in range(stages):
        share = base + (1 if index < extra else 0)
        share -= first if index == 0 else last if index == stages - 1 else 0
        counts.append(min(share, left))
        left -= counts[-1]
    return tuple(counts) if left == 0 else None


def degrees(layout: TrainingLayout) -> dict[str, int]:
    """torchtitan's ``--parallelism.*_degree`` values for ``layout``.

    torchtitan's world is ``pp x dp_replicate x dp_shard x cp x tp`` with ep carved out of
    ``dp_shard x cp x tp``, so ``ok.plan``'s ``dp x ep`` replicas become ``dp_replicate x
    dp_shard``: fsdp (and zero1/zero2, which torchtitan lacks) ``1 x dp*ep``, hsdp
    ``dp/dp_shard x dp_shard*ep``, ddp ``dp x ep``.
    """
    if layout.sharding == "hsdp":
        replicate, shard = layout.dp // layout.dp_shard, layout.dp_shard * layout.ep
    elif layout.sharding == "ddp":
        replicate, shard = layout.dp, layout.ep
    else:
        replicate, shard = 1, layout.dp * layout.ep
    return {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": layout.tp,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
        "expert_parallel_degree": layout.ep,
    }


@dataclass(frozen=True, slots=True)
class TorchtitanRun:
    """The ``torchtitan.train`` arguments for a layout, and what they cannot carry."""

    args: list[str]
    config: RegisteredConfig | None
    warnings: list[str] = field(default_factory=list)
    version: str = TORCHTITAN_VERSION

    def to_dict(self) -> dict:
        """``run.torchtitan`` of ``plan --auto --json`` (docs/json-contracts.md)."""
        return {
            "version": self.version,
            "args": self.args,
            "module": self.config.module if self.config else None,
            "config": self.config.config if self.config else None,
            "warnings": self.warnings,
        }


def torchtitan_run(
    layout: TrainingLayout,
    model: ModelSpec,
    *,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    placement: Placement | None = None,
) -> TorchtitanRun:
    """The ``torchtitan.train`` arguments that run ``layout`` of ``model``.

    Args:
        layout (TrainingLayout): the plan's sizes, micro-batching, recomputation, sharding.
        model (ModelSpec): the model; a registered config of its shape is named.
        seq_len (int): tokens per sequence (``--training.seq_len``).
        global_batch (int): sequences per step (``--training.global_batch_size``).
        precision (str): what the plan priced (``bf16``, ``fp8``). Defaults to ``bf16``.
        placement (Placement | None): the planner's (``ok.plan``), for the warning where
            torchtitan's rank order differs from it.

    Returns:
        TorchtitanRun: the arguments in order (``--module``/``--config`` first where a config
        matches, the ``activation-checkpoint:`` subcommand last), the config, and one warning
        per thing torchtitan refuses at start-up or runs otherwise than planned.
    """
    config = next((c for c in REGISTERED if c.matches(model)), None)
    args, warnings = _model_args(config, model, precision)
    for key, value in degrees(layout).items():
        args += [f"--parallelism.{key}", str(value)]
    pipelined = layout.pp > 1
    keep = pipelined or layout.sharding in ("zero1", "zero2")
    args += ["--parallelism.fsdp_reshard_after_forward", "never" if keep else "always"]
    args += [
        "--parallelism.pipeline_parallel_schedule",
        schedule_of(layout),
        "--parallelism.pipeline_parallel_microbatch_size",
        str(layout.micro_batch),
    ]
    if pipelined:
        stage_args, stage_warnings = _stage_args(layout, model)
        args += stage_args
        warnings += stage_warnings
    local = layout.micro_batch * (layout.num_micro_batches if pipelined else 1)
    args += [
        "--training.local_batch_size",
        str(local),
        "--training.global_batch_size",
        str(global_batch),
        "--training.seq_len",
        str(seq_len),
    ]
    if pipelined or layout.ep > 1:
        args.append("--training.disable_cuda_graphs")
    args.append(f"activation-checkpoint:{layout.recompute}")
    warnings += _refused_at_start(layout, model, seq_len)
    warnings += _untransferred(layout, model, placement)
    return TorchtitanRun(args, config, warnings)


def _model_args(
    config: RegisteredConfig | None, model: ModelSpec, precision: str
) -> tuple[list[str], list[str]]:
    """(``--module``/``--config`` of the registered ``config``, warnings): where none matches
    ``model``, no arguments and a warning; where it trains at another precision than the plan
    priced, a warning."""
    if config is None:
        names = ", ".join(c.config for c in REGISTERED)
        return [], [
            f"torchtitan {TORCHTITAN_VERSION} registers no config for {model.name} (its configs "
            f"for the planner's models: {names}; model_spec cannot be set on its command line): "
            "the arguments carry the degrees, batch and recomputation only; put --module and "
            "--config of a config_registry of your own in front of them"
        ]
    args = ["--module", config.module, "--config", config.config]
    if config.precision == precision:
        return args, []
    return args, [
        f"{config.config} trains in {config.precision}"
        + (f" with {config.trains}" if config.trains else "")
        + f"; the plan priced {precision}: price it with --precision {config.precision}"
    ]


def _stage_args(layout: TrainingLayout, model: ModelSpec) -> tuple[list[str], list[str]]:
    """(the stage split's arguments, warnings) for ``pp x v`` stages: layers per stage with the
    embedding's and head's weights, or module by module; a warning where torchtitan cannot
    split them or puts more layers on a rank than the plan priced."""
    stages = layout.pp * layout.virtual_stages
    split = torchtitan_stage_split(model.layers, stages)
    if split is None:
        return [], [f"torchtitan cannot split {model.layers} layers into {stages} stages (pp x v)"]
    if split.layers_per_stage is None:
        args = ["--parallelism.module_fqns_per_model_part", *split.module_names()]
    else:
        args = [
            "--parallelism.pipeline_parallel_layers_per_stage",
            str(split.layers_per_stage),
            "--parallelism.pipeline_parallel_first_stage_less_layers",
            str(split.first_weight),
            "--parallelism.pipeline_parallel_last_stage_less_layers",
            str(split.last_weight),
        ]
    planned = layers_per_stage(model, layout)
    fullest = max(split.rank_layers(layout.pp))
    if fullest <= planned:
        return args, []
    return args, [
        f"torchtitan's stage split puts up to {fullest} layers on a pipeline rank "
        f"(stages of {', '.join(map(str, split.stage_layers))}); the plan priced {planned}"
    ]


def _refused_at_start(layout: TrainingLayout, model: ModelSpec, seq_len: int) -> list[str]:
    """What torchtitan's start-up checks refuse (``Trainer.__init__``, ``update_from_config``)."""
    out = []
    divisor = layout.tp * (2 * layout.cp if layout.cp > 1 else 1)
    if seq_len % divisor:
        out.append(
            f"torchtitan refuses --seq-len {seq_len}: it must divide by tp x 2cp = {divisor} "
            "(sequence parallelism, and context parallelism's head-tail load balancing)"
        )
    if layout.tp > 1 and (model.heads % layout.tp or model.kv_heads % layout.tp):
        out.append(
            f"torchtitan refuses tp={layout.tp}: it must divide the {model.heads} heads and "
            f"the {model.kv_heads} kv heads"
        )
    return out


def _untransferred(
    layout: TrainingLayout, model: ModelSpec, placement: Placement | None
) -> list[str]:
    """What of ``layout`` torchtitan runs otherwise than planned: ``full:K`` recomputation,
    experts split over tp, ZeRO-1/2, ep or cp with ddp or hsdp, and the placement where its
    rank order differs from the planner's."""
    out = []
    if layout.recompute_layers is not None:
        out.append(
            f"recompute full:{layout.recompute_layers}: torchtitan's full activation "
            f"checkpointing wraps every block (all {model.layers} layers), not "
            f"{layout.recompute_layers} of each stage"
        )
    if layout.tp > 1 and layout.ep > 1:
        out.append(
            f"the plan splits the experts over tp x ep = {layout.tp * layout.ep} GPUs; "
            f"torchtitan {TORCHTITAN_VERSION} has no expert tensor parallelism: its "
            f"ep={layout.ep} ranks come out of dp_shard x cp x tp and hold whole experts"
        )
    if layout.sharding in ("zero1", "zero2"):
        out.append(
            f"torchtitan has no {layout.sharding}: handed over as FSDP with "
            "fsdp_reshard_after_forward never (the parameters sharded too, gathered for "
            "forward and kept for backward)"
        )
    spread = [f"{k}={v}" for k, v in (("cp", layout.cp), ("ep", layout.ep)) if v > 1]
    if spread and layout.sharding in ("ddp", "hsdp"):
        shard = degrees(layout)["data_parallel_shard_degree"]
        out.append(
            f"{layout.sharding} with {' and '.join(spread)}: torchtitan shards the dense "
            f"parameters over dp_shard x cp = {shard * layout.cp} GPUs (ep comes out of that "
            "group, cp > 1 always shards)"
        )
    if placement is not None:
        in_rank_order = tuple(placement.ranks) == tuple(range(len(placement.ranks)))
        if not in_rank_order or (layout.ep > 1 and layout.cp * layout.tp > 1):
            why = (
                "the planner's rank grid is not in rank order"
                if not in_rank_order
                else "its ep groups are the innermost ranks of dp_shard x cp x tp, the "
                "planner's lie outside cp and tp"
            )
            out.append(
                f"only the degrees transfer: torchtitan lays its mesh out in rank order "
                f"{', '.join(TORCHTITAN_MESH_ORDER)}, and {why}"
            )
    return out
