"""Run torchtitan's own parsing and start-up checks on argument lists (a subprocess of
``tests/test_torchtitan_handoff.py``, so each mesh is built under a fresh fake process group and
nothing of torchtitan stays imported in the test process).

Reads ``{"cases": [{"name", "args", "world_size"}], "configs": [[module, function]],
"flavors": [[module, flavor]]}`` as JSON on stdin and writes one JSON object to the file named
by its argument (torchtitan prints to stdout): per case what
torchtitan made of the arguments, or the error it stopped with; per registered config the model
shape it trains. For each case, in torchtitan 0.3.0's order:

1. ``ConfigManager().parse_args(args)``: loads ``--module``/``--config``, parses the overrides
   with tyro (an unknown key exits 2) and runs ``Trainer.Config.__post_init__`` (CUDA graphs
   with pp or ep, the pipeline micro-batch dividing the local batch, ...);
2. the model config's ``update_from_config`` (tp dividing the heads, the sequence length);
3. ``ParallelDims.from_config(...)`` and ``build_mesh()`` for the world size under
   torch's fake process group (as torchtitan's own unit tests build meshes on CPU);
4. ``Trainer.__init__``'s checks, copied from ``torchtitan/trainer.py`` (they are inline there):
   ``seq_len`` divisible by ``tp x 2cp``, the global batch by ``local x batch degree``;
5. with pp > 1: ``get_schedule_class``, ``_get_pipeline_metadata`` (stage count against
   pp and the schedule) and ``_generate_llm_fqn_per_model_part`` (the split itself) or the
   ``module_fqns_per_model_part`` given (as many stages per rank, every module once), and
   torch's ``ScheduleInterleaved1F1B`` rule that the micro-batches divide into rounds;
6. with cp > 1 under the spmd_types / full_dtensor backends: ``validate_config`` on the model
   built on the meta device (CP needs FlexAttention there).

Where triton is not installed (a CPU host: its wheel is a 286 MB GPU compiler build), the one
torchtitan module that holds Triton kernels, ``distributed.minimal_async_ep.kernels`` (imported
by every model package, its kernels run only by MinimalAsyncEP on CUDA), is replaced by a module
whose every name raises if called; nothing else is stood in for.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_META_MODELS: dict = {}
"""A named config's model, built once on the meta device."""


def _kernels_stand_in() -> None:
    def unavailable(name: str):
        def kernel(*args, **kwargs):
            raise RuntimeError(f"{KERNELS}.{name}: a Triton kernel, not on this host")

        return kernel

    def attribute(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return unavailable(name)

    module = types.ModuleType(KERNELS)
    module.__getattr__ = attribute
    sys.modules[KERNELS] = module


def _shape(model) -> dict:
    """The model config's shape, in the planner's terms."""
    layers = list(model.layers.values()) if isinstance(model.layers, dict) else model.layers
    last = layers[-1]
    moe = getattr(last, "moe", None)
    return {
        "layers": len(layers),
        "hidden": model.dim,
        "heads": last.attention.n_heads,
        "vocab_size": model.vocab_size,
        "experts": moe.num_experts if moe is not None else 0,
    }


def _case(args: list[str], world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        ScheduleInterleaved1F1B,
        get_schedule_class,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.full_dtensor import validate_config
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
    )

    try:
        config = ConfigManager().parse_args(args)
    except SystemExit as exit_:
        return {"ok": False, "stage": "parse", "error": f"exit {exit_.code}"}
    model_config = config.model_spec.model if config.model_spec is not None else None
    if model_config is not None:
        model_config.update_from_config(config=config)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims = ParallelDims.from_config(config.parallelism, world_size)
        dims.build_mesh()
        meshes = {k: m.size() for k, m in dims.get_all_one_dimensional_meshes().items()}
        training, parallelism = config.training, config.parallelism
        divisor = (dims.tp if parallelism.enable_sequence_parallel else 1) * (
            2 * dims.cp if dims.cp > 1 else 1
        )
        if training.seq_len % divisor:
            raise ValueError(f"seq_len {training.seq_len} not divisible by {divisor}")
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * batch_degree
        if global_batch % (training.local_batch_size * batch_degree):
            raise ValueError(
                f"global batch {global_batch} % (local {training.local_batch_size} x "
                f"batch degree {batch_degree}) != 0"
            )
        out = {
            "ok": True,
            "degrees": {
                "dp_replicate": dims.dp_replicate,
                "dp_shard": dims.dp_shard,
                "cp": dims.cp,
                "tp": dims.tp,
                "pp": dims.pp,
                "ep": dims.ep,
            },
            "meshes": meshes,
            "batch_degree": batch_degree,
            "accumulation": global_batch // (training.local_batch_size * batch_degree),
            "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
            "reshard_after_forward": parallelism.fsdp_reshard_after_forward,
            "seq_len": training.seq_len,
        }
        if dims.pp_enabled:
            schedule = get_schedule_class(parallelism.pipeline_parallel_schedule)
            # As pipeline_llm: the metadata's checks, then the modules named or generated.
            stages, layers, first, last = _get_pipeline_metadata(dims, parallelism, model_config)
            parts = parallelism.module_fqns_per_model_part
            if parts is None:
                parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
            else:
                every = ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm"]
                per_rank, extra = divmod(len(parts), dims.pp)
                looped = issubclass(schedule, PipelineScheduleMulti)
                if (
                    [n for p in parts for n in p] != [*every, "lm_head"]
                    or extra
                    or (per_rank != 1 if not looped else per_rank < 2)
                ):
                    raise ValueError(f"module_fqns_per_model_part: {len(parts)} stages {parts}")
            micro = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
            if schedule is ScheduleInterleaved1F1B and micro % max(1, micro // dims.pp):
                raise ValueError(f"{micro} micro-batches do not divide into rounds of {dims.pp}")
            out |= {
                "schedule": schedule.__name__,
                "looped": issubclass(schedule, PipelineScheduleMulti),
                "n_microbatches": micro,
                "stage_layers": [sum(n.startswith("layers.") for n in p) for p in parts],
            }
        if dims.cp_enabled and parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
            named = tuple(args[args.index(flag) + 1] for flag in ("--module", "--config"))
            if named not in _META_MODELS:  # its attention modules are what is checked
                with torch.device("meta"):
                    _META_MODELS[named] = model_config.build()
            validate_config(dims, _META_MODELS[named])
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    if importlib.util.find_spec("triton") is None:
        _kernels_stand_in()
    logging.disable(logging.WARNING)
    request = json.load(sys.stdin)
    results: dict = {"cases": {}, "configs": {}, "flavors": {}}
    for case in request.get("cases", []):
        try:
            results["cases"][case["name"]] = _case(case["args"], case["world_size"])
        except Exception as err:  # what torchtitan stopped with, reported to the test
            results["cases"][case["name"]] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    for module, function in request.get("configs", []):
        registry = importlib.import_module(f"torchtitan.models.{module}.config_registry")
        try:
            shape = _shape(getattr(registry, function)().model_spec.model)
        except Exception as err:
            shape = {"error": f"{type(err).__name__}: {err}"}
        results["configs"][function] = shape
    for module, flavor in request.get("flavors", []):
        spec = importlib.import_module(f"torchtitan.models.{module}").model_registry(flavor)
        results["flavors"][f"{module}:{flavor}"] = _shape(spec.model)
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
