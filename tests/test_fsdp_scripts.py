"""What real FSDP2 scripts do, with ``ok.fsdp`` in place of their ``fully_shard`` calls.

pytorch/examples' FSDP2 example (``tests/fsdp2_recipe.py``) builds its model on the meta device,
passes ``fully_shard``'s own keywords (``mp_policy``), may set its own explicit prefetch, then
``to_empty``, initialises, trains and checkpoints with DCP. Each variant runs twice on the same
2 gloo ranks, with plain ``fully_shard`` per layer and root and with ``ok.fsdp(model, prefetch=1,
**fsdp_kwargs)``, and everything must match bitwise: the initial and trained parameters and
the losses, and for the example's own modes (``RESUMED``) the parameters after resuming from
DCP's sharded checkpoint and from the example's full state dict broadcast onto a meta model.
``ok.fsdp``'s refusals of what cannot run are checked in the same launch.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
)

import overlapkit as ok
from overlapkit.fsdp.state import state_of
from tests import fsdp2_recipe as recipe
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
VARIANTS = {
    "meta": {},
    "mixed_precision": {"mp_policy": BF16},
    "explicit_prefetching": {},
    "cpu_offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    "reshard_to_1": {"reshard_after_forward": 1},
    "reshard_to_2": {"reshard_after_forward": 2},
}
RESUMED = ("meta", "mixed_precision", "explicit_prefetching")
"""The example's own modes also resume (from DCP and from the full state dict); the other
keywords are compared over the training (each resumed run costs two more sharded models)."""
TRAINED = ("initial", "trained", "losses", "continued")


def _plain(fsdp_kwargs: dict):
    def shard(model):
        for layer in model.layers:
            fully_shard(layer, **fsdp_kwargs)
        return fully_shard(model, **fsdp_kwargs)

    return shard


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _variant(name: str, root: str) -> dict:
    """The recipe with ``fully_shard`` and with ``ok.fsdp``; an error is returned, not raised,
    so that each variant's test fails on its own."""
    fsdp_kwargs, explicit = VARIANTS[name], name == "explicit_prefetching"
    resume = name in RESUMED
    compared = (*TRAINED, "resumed_dcp", "resumed_full") if resume else TRAINED
    warnings = _Warnings()
    logging.getLogger("overlapkit").addHandler(warnings)
    try:
        plain = recipe.run(
            _plain(fsdp_kwargs), f"{root}/{name}/plain", explicit=explicit, resume=resume
        )
        ours = recipe.run(
            lambda model: ok.fsdp(model, prefetch=1, **fsdp_kwargs),
            f"{root}/{name}/ok",
            explicit=explicit,
            resume=resume,
        )
        stats = ok.fsdp_stats(ours["model"])
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        logging.getLogger("overlapkit").removeHandler(warnings)
    return {
        "plain": {key: plain[key] for key in compared},
        "ok": {key: ours[key] for key in compared},
        "mesh_device": ours["model"].tok_embeddings.weight.device_mesh.device_type,
        "peaks": [(s.forward_peak_blocks, s.backward_peak_blocks) for s in stats.steps],
        # The gloo overlap path: prefetched all-gathers return pending, reduce-scatters overlap.
        "async_gathers": [e.async_op for e in stats.last_step_events if e.kind == "all_gather"],
        "async_reduce_scatters": state_of(ours["model"], caller="test").pending.issued,
        "bounds": (stats.forward_bound_blocks, stats.backward_bound_blocks),
        "within_bound": stats.within_bound(),
        "prefetch_replaced": stats.prefetch_replaced,
        "warnings": [m for m in warnings.messages if "prefetch" in m],
    }


def _refusal(**options) -> tuple[str, str] | None:
    with torch.device("meta"):
        model = recipe.Transformer()
    try:
        ok.fsdp(model, **options)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


REFUSED = {
    "both_mixed_precisions": dict(mixed_precision="bf16", mp_policy=BF16),
    "mp_policy_shorthand": dict(mp_policy="bf16"),
    "offload_not_a_policy": dict(offload_policy="cpu"),
    "pinned_offload_without_accelerator": dict(offload_policy=CPUOffloadPolicy()),
    "reshard_not_a_divisor": dict(reshard_after_forward=3),
    "reshard_not_an_int": dict(reshard_after_forward=2.0),
    "reshard_int_with_zero": dict(reshard_after_forward=2, zero=1),
}


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {name: _variant(name, root) for name in VARIANTS}
    out["refused"] = {name: _refusal(**options) for name, options in REFUSED.items()}
    with torch.device("meta"):
        model = recipe.Transformer()
    mesh = init_device_mesh("cpu", (world_size,))
    try:
        ok.fsdp(model, mesh=mesh)
        out["meta_with_given_mesh"] = model.output.weight.device_mesh == mesh
    except Exception as error:
        out["meta_with_given_mesh"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("fsdp2_recipe"))
    return run_on_ranks(_two_ranks, 2, root, collective_timeout_s=60, total_timeout_s=300)


def _assert_same_run(result: dict, what: str) -> None:
    assert "error" not in result, f"{what}: {result.get('error')}"
    assert result["ok"].keys() == result["plain"].keys()
    for key in result["plain"]:
        assert_bitwise(result["ok"][key], result["plain"][key], f"{what} {key}")
    changed = [
        k
        for k in result["ok"]["initial"]
        if torch.equal(result["ok"]["initial"][k], result["ok"]["trained"][k])
    ]
    assert not changed, f"{what}: parameters the training did not change: {changed}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_fsdp2_example_with_ok_fsdp_matches_fully_shard_bitwise(two_ranks, variant):
    for rank, result in enumerate(two_ranks):
        _assert_same_run(result[variant], f"rank {rank} {variant}")
        if variant in RESUMED:
            assert {"resumed_dcp", "resumed_full"} <= result[variant]["ok"].keys()


@pytest.mark.slow
def test_a_meta_model_gets_its_mesh_and_overlap_path_from_the_process_group(two_ranks):
    for result in two_ranks:
        meta = result["meta"]
        assert meta["mesh_device"] == "cpu"  # gloo's, not the parameters' "meta"
        # The gloo overlap path ran: every all-gather was issued pending, the reduce-scatters of
        # every layer and step overlapped backward, and prefetch=1 held two blocks at most.
        assert meta["async_gathers"] and all(meta["async_gathers"]), meta["async_gathers"]
        steps = recipe.STEPS + recipe.RESUMED_STEPS  # the model trained, then continued
        assert meta["async_reduce_scatters"] >= recipe.LAYERS * steps, meta
        assert all(peaks == (2, 2) for peaks in meta["peaks"]), meta["peaks"]
        assert meta["within_bound"]
        assert result["meta_with_given_mesh"] is True, result["meta_with_given_mesh"]


@pytest.mark.slow
def test_a_scripts_own_prefetch_warns_once_naming_both_and_reports_the_bound_in_force(
    two_ranks,
):
    for result in two_ranks:
        explicit = result["explicit_prefetching"]
        assert explicit["prefetch_replaced"]
        assert explicit["bounds"] == (3, 3)  # the layer plus the two it prefetches
        assert all(peaks == (3, 3) for peaks in explicit["peaks"]), explicit["peaks"]
        assert explicit["within_bound"]
        # Once per model (the trained one and the two resumed), not once per step.
        assert len(explicit["warnings"]) == 3, explicit["warnings"]
        warning = explicit["warnings"][0]
        assert "ok.fsdp(prefetch=1)" in warning
        assert "set_modules_to_forward_prefetch: 'layers.0' prefetches" in warning
        assert "['layers.1', 'layers.2'] (ok.fsdp set ['layers.1'])" in warning
        assert "set_modules_to_backward_prefetch: 'layers.2' prefetches" in warning
        assert "3 unsharded blocks in forward and 3 in backward (ok.fsdp's: 2 and 2)" in warning
        assert not result["meta"]["warnings"] and not result["meta"]["prefetch_replaced"]


@pytest.mark.slow
def test_an_int_reshard_after_forward_is_fully_shards_meaning(two_ranks):
    for result in two_ranks:
        # 1 keeps every layer gathered after forward (FSDP2's False), 2 (= the 2 ranks) frees it.
        assert result["reshard_to_1"]["bounds"] == (recipe.LAYERS, recipe.LAYERS)
        assert result["reshard_to_2"]["bounds"] == (2, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("both_mixed_precisions", "ValueError", "mixed_precision='bf16' and mp_policy="),
        ("mp_policy_shorthand", "TypeError", "mp_policy must be a"),
        ("offload_not_a_policy", "TypeError", "offload_policy must be a"),
        (
            "pinned_offload_without_accelerator",
            "ValueError",
            "pass CPUOffloadPolicy(pin_memory=False)",
        ),
        (
            "reshard_not_a_divisor",
            "ValueError",
            "reshard_after_forward=3 must divide the mesh's shard axis (2 ranks)",
        ),
        ("reshard_not_an_int", "TypeError", "got 2.0"),
        ("reshard_int_with_zero", "ValueError", "zero=1 keeps the parameters gathered"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line_naming_the_value(two_ranks, name, error, words):
    found = two_ranks[0]["refused"][name]
    assert found is not None, f"{name} was accepted"
    assert found[0] == error and found[1].startswith("ok.fsdp: "), found
    assert words in found[1] and "\n" not in found[1], found


CUDA_VARIANTS = {
    "meta": ({}, False, "cuda"),
    "mixed_precision_explicit_prefetching": ({"mp_policy": BF16}, True, "cuda"),
    "pinned_cpu_offload": ({"offload_policy": CPUOffloadPolicy()}, False, "cpu"),
}


@requires_cuda
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_the_fsdp2_example_on_cuda_with_ok_fsdp_matches_fully_shard_bitwise(tmp_path, variant):
    """One GPU, NCCL: the mesh from the process group's device (CUDA), FSDP2's streams, pinned
    CPU offloading (the sharded parameters materialised on the CPU)."""
    fsdp_kwargs, explicit, materialize_on = CUDA_VARIANTS[variant]
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {
            name: recipe.run(
                shard,
                str(tmp_path / name),
                explicit=explicit,
                device="cuda",
                materialize_on=materialize_on,
            )
            for name, shard in (
                ("plain", _plain(fsdp_kwargs)),
                ("ok", lambda model: ok.fsdp(model, prefetch=1, **fsdp_kwargs)),
            )
        }
        mesh = runs["ok"]["model"].tok_embeddings.weight.device_mesh.device_type
    finally:
        dist.destroy_process_group()
    runs = {name: {k: v for k, v in run.items() if k != "model"} for name, run in runs.items()}
    _assert_same_run(runs, f"cuda {variant}")
    assert mesh == "cuda"
