"""How to run a chosen layout: ``overlapkit-train`` overrides, or a DeviceMesh and a torchtitan
config where overlapkit-train cannot run it.

overlapkit-train runs data parallelism with ``ok.ddp`` / ``ok.GradBucketer`` (``parallel=ddp``),
``ok.fsdp`` (``parallel=fsdp``) and HSDP (``parallel=hsdp``, ``parallel.plan.dp_shard``), tensor
parallelism with the bucketer (``parallel=tp_dp``, ``parallel.plan.tp``) and expert parallelism
with it (``parallel=ep_dp``, ``parallel.plan.ep``); not tensor with expert parallelism together,
nor tensor parallelism under FSDP (``overlapkit/train/mesh.py`` refuses both). It has no
context or pipeline parallelism, no activation recomputation and no ZeRO-1/2 optimizer sharding:
what it runs is ``autoplan.framework.OVERLAPKIT_TRAIN``'s ``lacks`` / ``refusal``.
``train.batch_size`` is the micro-batch per rank and ``train.grad_accum`` the micro-batches; a
recomputing layout (once the framework runs one) adds ``train.recompute`` and, for full
recomputation of some layers, ``train.recompute_layers`` (layers of each pipeline stage).
"""

from __future__ import annotations

from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN, Framework
from overlapkit.planner.layout import TrainingLayout

TRAIN_MODELS = ("gpt_tiny", "moe_tiny", "mlp")
"""overlapkit-train's model zoo (``conf/model``)."""


def train_overrides(
    layout: TrainingLayout,
    *,
    topology: str,
    nodes: int,
    ranks_per_node: int,
    model: str | None,
    framework: Framework = OVERLAPKIT_TRAIN,
) -> list[str]:
    """The ``overlapkit-train`` command-line overrides that run ``layout``.

    ``framework``: what overlapkit-train runs (``OVERLAPKIT_TRAIN``; a test passes one that
    runs more, as overlapkit-train will).

    Raises:
        ValueError: overlapkit-train cannot run ``layout`` (the message says why).
    """
    refusal = framework.refusal(layout)
    if refusal is not None:
        raise ValueError(refusal)
    if layout.tp > 1:
        parallel = ["parallel=tp_dp", f"parallel.plan.tp={layout.tp}"]
    elif layout.ep > 1:
        parallel = ["parallel=ep_dp", f"parallel.plan.ep={layout.ep}"]
    elif layout.sharding == "hsdp":
        parallel = ["parallel=hsdp", f"parallel.plan.dp_shard={layout.dp_shard}"]
    elif layout.sharding == "fsdp":
        parallel = ["parallel=fsdp"]
    else:
        parallel = ["parallel=ddp"]
    args = [f"model={model}"] if model in TRAIN_MODELS else []
    args += [
        *parallel,
        f"train.batch_size={layout.micro_batch}",
        f"train.grad_accum={layout.num_micro_batches}",
        *recompute_overrides(layout),
        "topology=preset",
        f"topology.name_or_path={topology}",
        f"launcher.nnodes={nodes}",
        f"launcher.nproc_per_node={ranks_per_node}",
    ]
    if nodes > 1:
        args.append("launcher=multinode")
    return args


def recompute_overrides(layout: TrainingLayout) -> list[str]:
    """``train.recompute`` (and ``train.recompute_layers``, per pipeline stage) for ``layout``:
    none when it recomputes nothing."""
    if layout.recompute == "none":
        return []
    out = [f"train.recompute={layout.recompute}"]
    if layout.recompute_layers is not None:
        out.append(f"train.recompute_layers={layout.recompute_layers}")
    return out


def torchtitan_config(layout: TrainingLayout, *, seq_len: int, global_batch: int) -> str:
    """The ``[parallelism]``, ``[training]`` and ``[activation_checkpoint]`` sections of a
    torchtitan job config for ``layout``.

    torchtitan carves expert parallelism out of the data-parallel shard degree, so its
    ``data_parallel_*`` degrees multiply to ``dp x ep`` here; ZeRO-1/2 have no torchtitan
    equivalent and map to FSDP.
    """
    dp = layout.dp * layout.ep
    if layout.sharding == "hsdp":
        replicate, shard = layout.dp // layout.dp_shard, layout.dp_shard * layout.ep
    elif layout.sharding == "ddp":
        replicate, shard = dp, 1
    else:
        replicate, shard = 1, dp
    schedule = "Interleaved1F1B" if layout.virtual_stages > 1 else "1F1B"
    lines = [
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f"tensor_parallel_degree = {layout.tp}",
        f"context_parallel_degree = {layout.cp}",
        f"pipeline_parallel_degree = {layout.pp}",
        f"expert_parallel_degree = {layout.ep}",
    ]
    if layout.pp > 1:
        lines += [
            f'pipeline_parallel_schedule = "{schedule}"',
            f"pipeline_parallel_microbatch_size = {layout.micro_batch}",
        ]
    lines += [
        "",
        "[training]",
        f"global_batch_size = {global_batch}",
        f"local_batch_size = {global_batch // dp}",
        f"seq_len = {seq_len}",
        "",
        "[activation_checkpoint]",
        f'mode = "{layout.recompute}"',
    ]
    if layout.recompute_layers is not None:
        lines.append(
            f"# the planner recomputes {layout.recompute_layers} layers of each pipeline stage; "
            "torchtitan's full mode recomputes every layer"
        )
    if layout.sharding in ("zero1", "zero2"):
        lines.insert(0, f"# {layout.sharding}: torchtitan shards with FSDP instead")
    return "\n".join(lines)
