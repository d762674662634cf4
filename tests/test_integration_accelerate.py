"""Real ``Accelerator.prepare`` and HF ``Trainer.train()`` on two gloo ranks with overlapkit.

Each rank runs as under ``accelerate launch``/torchrun (``LOCAL_RANK`` set, the process group
already initialised), with a tiny model built here and nothing downloaded. One spawn trains, with
the same model and data each time: plain Accelerate (the reference), ``use_ok_ddp`` (fp32 and
bf16 on gloo), plain ``Trainer`` and ``OverlapTrainer``; then the per-bucket runs of
``tests/accelerate_per_bucket.py`` (``use_ok_ddp(optimizer_overlap=True)`` and
``OverlapTrainer(overlapkit_options={"optimizer_overlap": True})`` against plain Accelerate and
the plain Trainer, bitwise). Accelerate makes no GradScaler on CPU: its loss-scaling path runs
here in fp32 with one given to the accelerator; fp16 autocast with it needs CUDA
(``tests/test_per_bucket_integrations_cuda.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate", reason="the integrations extra is not installed")
pytest.importorskip("transformers", reason="the integrations extra is not installed")

from tests import accelerate_per_bucket as per_bucket
from tests import final_updates
from tests.doc_examples import assert_doc_examples_run_in_tests
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise
from tests.test_fsdp_blocks import make_mlp

STEPS = 3
PER_RANK = 4
WIDTH = 64
# As in the Lightning test: one bf16 rounding (2**-9 relative) of each all-reduced gradient,
# three SGD steps at lr 0.1 move the parameters by far less than this from fp32 DDP.
BF16_PARAM_TOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = 2 * PER_RANK * STEPS
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in module.named_parameters()}


def _accelerate(**overlap) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    import overlapkit as ok
    from overlapkit.integrations.accelerate import use_ok_ddp

    accelerator = Accelerator(cpu=True)
    if overlap:
        use_ok_ddp(accelerator, **overlap)
    model = make_mlp(blocks=4, width=WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(*_data()), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
    stats = ok.comm_stats(model) if overlap else None
    return {
        "params": _params(model),
        "records": len(stats.records) if stats else 0,
        "buckets": len(stats.by_bucket()) if stats else 0,
    }


class _Regressor(torch.nn.Module):
    """The Trainer's model: returns the loss, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = make_mlp(blocks=4, width=WIDTH)

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.net(x), labels)}


def _trainer(tmp: str, overlap: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    import overlapkit as ok
    from overlapkit.integrations.hf_trainer import OverlapTrainer

    x, y = _data()
    data = [{"x": xi, "labels": yi} for xi, yi in zip(x, y, strict=True)]
    args = TrainingArguments(
        output_dir=tmp,
        per_device_train_batch_size=PER_RANK,
        max_steps=STEPS,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        **final_updates.QUIET_CPU_TRAINER,
    )
    model = _Regressor()
    initial = _params(model)
    if overlap:
        trainer = OverlapTrainer(model=model, args=args, train_dataset=data, overlapkit_options={})
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {
        "initial": initial,
        "params": _params(model),
        "records": len(ok.comm_stats(trainer.model_wrapped).records) if overlap else 0,
    }


def _all_runs(rank: int, world_size: int, tmp: str) -> dict:
    from accelerate.utils import DistributedDataParallelKwargs

    from overlapkit.integrations.accelerate import OverlapDDPKwargs

    try:
        OverlapDDPKwargs(comm_hook="bf16")
        hook_error = None
    except ValueError as e:
        hook_error = str(e)
    return {
        "plain": _accelerate(),
        "overlap": _accelerate(compress=None),
        "bf16": _accelerate(compress="bf16", bucket_mb=0.02),
        "trainer_plain": _trainer(os.path.join(tmp, "plain"), overlap=False),
        "trainer_overlap": _trainer(os.path.join(tmp, "overlap"), overlap=True),
        "hook_error": hook_error,
        # DDP options stay DDP's: ours are not passed to the DDP constructor.
        "ddp_kwargs": OverlapDDPKwargs(bucket_cap_mb=5, compress="bf16").to_kwargs(),
        "plain_kwargs": DistributedDataParallelKwargs(bucket_cap_mb=5).to_kwargs(),
        "per_bucket": per_bucket.scenarios(os.path.join(tmp, "per_bucket")),
        # Last: its Accelerate run ends with end_training, which destroys the process group.
        "final_updates": final_updates.scenarios(os.path.join(tmp, "final")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf"))
    return run_on_ranks(
        _all_runs, 2, tmp, total_timeout_s=400, collective_timeout_s=60, env=OFFLINE
    )


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_use_ok_ddp_matches_plain_accelerate(two_ranks):
    for result in two_ranks:
        assert _max_diff(result["overlap"]["params"], result["plain"]["params"]) < 1e-6
        assert result["overlap"]["records"] >= STEPS  # ok.ddp's hook ran every step
    assert _max_diff(two_ranks[0]["overlap"]["params"], two_ranks[1]["overlap"]["params"]) == 0


@pytest.mark.slow
def test_use_ok_ddp_compresses_to_bf16_on_gloo(two_ranks):
    for result in two_ranks:
        diff = _max_diff(result["bf16"]["params"], result["plain"]["params"])
        assert 0 < diff < BF16_PARAM_TOL
        assert result["bf16"]["buckets"] > 1  # bucket_mb=0.02 reached Accelerate's DDP


@pytest.mark.slow
def test_overlap_trainer_matches_plain_trainer(two_ranks):
    for result in two_ranks:
        overlap, plain = result["trainer_overlap"], result["trainer_plain"]
        assert _max_diff(overlap["params"], plain["params"]) < 1e-6
        # The Trainer really trained (parameters moved) and ok.ddp's hook saw every step.
        assert _max_diff(plain["params"], plain["initial"]) > 1e-3
        assert overlap["records"] >= STEPS


@pytest.mark.slow
def test_overlap_kwargs_keep_ddp_options_and_refuse_accelerates_hook(two_ranks):
    result = two_ranks[0]
    assert result["ddp_kwargs"] == result["plain_kwargs"] == {"bucket_cap_mb": 5}
    assert result["hook_error"] is not None and "comm_hook" in result["hook_error"]


# -- per-bucket updates (tests/accelerate_per_bucket.py), against plain Accelerate and Trainer


FORMS = ("plain", "per_bucket")


def _trained(result: dict, norms: str) -> dict:
    return {"params": result["params"], "optim": result["optim"], norms: result[norms]}


@pytest.mark.slow
def test_use_ok_ddp_per_bucket_trains_bitwise_as_accelerates_ddp(two_ranks):
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"]["accelerate"]
        plain = _trained(runs["plain"], "norms")
        # One prepare call or two (model first, then the optimizer).
        for name in ("per_bucket", "two_calls"):
            assert_bitwise(_trained(runs[name], "norms"), plain, f"rank {rank} {name}")
        # Evaluated under inference_mode right after each step, updates still pending.
        assert_bitwise(runs["per_bucket"]["evals"], runs["plain"]["evals"], f"rank {rank}")
        assert runs["plain"]["ddp"] == [True] * per_bucket.STEPS
        assert runs["per_bucket"]["ddp"] == [False] * per_bucket.STEPS
        # Stepped on sync steps only: once per optimizer step, not per micro-batch.
        assert runs["per_bucket"]["bucketer_steps"] == list(range(per_bucket.STEPS))
    # Rank 1 built other weights: both forms trained rank 0's.
    first, second = (r["per_bucket"]["accelerate"]["per_bucket"] for r in two_ranks)
    assert_bitwise(second["params"], first["params"], "ranks")


@pytest.mark.slow
def test_use_ok_ddp_per_bucket_grad_scaler_skips_the_same_steps_and_holds_the_schedule(two_ranks):
    for rank, result in enumerate(two_ranks):
        plain, overlap = (result["per_bucket"]["accelerate"]["scaled"][f] for f in FORMS)
        assert_bitwise(overlap["params"], plain["params"], f"rank {rank}")
        assert_bitwise(overlap["optim"], plain["optim"], f"rank {rank}")
        # optimizer_step_was_skipped (PerBucketOptimizer.step_was_skipped) as under DDP, on
        # some steps and not others, and the prepared LR scheduler held on those.
        assert overlap["skipped"] == plain["skipped"]
        assert any(plain["skipped"]) and not all(plain["skipped"]), plain["skipped"]
        assert overlap["lrs"] == plain["lrs"]
        assert overlap["bucketer_steps"] == list(range(per_bucket.STEPS))


@pytest.mark.slow
def test_accelerate_clipping_was_active_on_some_steps_only_and_matters(two_ranks):
    runs = two_ranks[0]["per_bucket"]["accelerate"]
    norms = runs["plain"]["norms"]
    assert any(n > per_bucket.ACCELERATE_MAX_NORM for n in norms), norms
    assert any(n < per_bucket.ACCELERATE_MAX_NORM for n in norms), norms
    unclipped, plain = runs["unclipped"]["params"], runs["plain"]["params"]
    assert any(not torch.equal(unclipped[k], plain[k]) for k in plain)  # control


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_parameters_read_right_after_the_step_need_synchronize(two_ranks, framework):
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"][framework]
        plain = runs["plain"]["snapshots"]["synchronized"]
        snapshots = runs["per_bucket"]["snapshots"]
        assert_bitwise(snapshots["synchronized"], plain, f"rank {rank}")
        stale = snapshots["unsynchronized"]  # control: updates still pending
        assert any(not torch.equal(stale[k], plain[k]) for k in plain)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_checkpoint_saved_by_either_form_resumes_in_the_other_bitwise(two_ranks, framework):
    norms = "norms" if framework == "accelerate" else "grad_norms"
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"][framework]
        reference = _trained(runs["plain"], norms)  # uninterrupted
        if framework == "accelerate":
            reference[norms] = reference[norms][per_bucket.CHECKPOINT_AT :]
        for (form, by), resumed in runs["resumed"].items():
            assert_bitwise(_trained(resumed, norms), reference, f"rank {rank} {form}<-{by}")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["create_optimizer", "own_optimizer"])
def test_overlap_trainer_per_bucket_trains_and_logs_bitwise_as_the_trainer(two_ranks, optimizer):
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"]["trainer"]
        pair = runs if optimizer == "create_optimizer" else runs[optimizer]
        plain, overlap = pair["plain"], pair["per_bucket"]
        assert_bitwise(_trained(overlap, "grad_norms"), _trained(plain, "grad_norms"), f"{rank}")
        assert overlap["eval_losses"] == plain["eval_losses"]  # evaluated mid-run
        assert [step for step, _ in plain["grad_norms"]] == [2, 4, 6, 8]  # logging steps only
        assert overlap["param_groups"] == 2  # the default create_optimizer's, or ours
        assert plain["ddp"] == [True] * per_bucket.STEPS
        assert overlap["ddp"] == [False] * per_bucket.STEPS
        assert overlap["bucketer_steps"] == list(range(per_bucket.STEPS))


@pytest.mark.slow
def test_overlap_trainer_norm_is_final_when_a_callback_added_later_logs_every_step(two_ranks):
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"]["trainer"]["late_callback"]
        plain, overlap = runs["plain"], runs["per_bucket"]
        assert [step for step, _ in plain["grad_norms"]] == list(range(1, per_bucket.STEPS + 1))
        assert_bitwise(_trained(overlap, "grad_norms"), _trained(plain, "grad_norms"), f"{rank}")


@pytest.mark.slow
def test_trainer_max_grad_norm_zero_measures_without_clipping(two_ranks):
    for rank, result in enumerate(two_ranks):
        runs = result["per_bucket"]["trainer"]
        plain, overlap = runs["no_clip"]["plain"], runs["no_clip"]["per_bucket"]
        assert_bitwise(_trained(overlap, "grad_norms"), _trained(plain, "grad_norms"), f"{rank}")
        # Control: clipping at TRAINER_MAX_NORM (active on logged steps 2, 4, 8) ends elsewhere.
        clipped = runs["plain"]
        assert any(
            not torch.equal(overlap["params"][k], clipped["params"][k]) for k in plain["params"]
        )
        norms = [n for _, n in clipped["grad_norms"]]
        assert any(n > per_bucket.TRAINER_MAX_NORM for n in norms), norms
        assert any(n < per_bucket.TRAINER_MAX_NORM for n in norms), norms


@pytest.mark.slow
def test_per_bucket_accelerate_refuses_what_it_cannot_run_as_ddp(two_ranks):
    refused = two_ranks[0]["per_bucket"]["refused"]
    assert "sync_each_batch=True" in refused["sync_each_batch"]
    assert "compress='bf16'" in refused["compress"]
    assert "clip_grad_value_(clip_value=0.1)" in refused["clip_value"]
    assert "sync_each_batch=True" in refused["trainer_sync_each_batch"]  # at OverlapTrainer()


@pytest.mark.slow
def test_overlap_trainer_returns_from_train_with_every_update_applied(two_ranks):
    for rank, result in enumerate(two_ranks):
        runs = result["final_updates"]["trainer"]
        assert_bitwise(runs["per_bucket"], runs["plain"], f"rank {rank} right after train()")


@pytest.mark.slow
@pytest.mark.parametrize("call", final_updates.ACCELERATE_CALLS)
def test_accelerate_calls_where_users_read_weights_apply_the_pending_updates(two_ranks, call):
    for rank, result in enumerate(two_ranks):
        runs = result["final_updates"]["accelerate"]
        plain, overlap = runs["plain"][call], runs["per_bucket"][call]
        assert_bitwise(overlap["read"], plain["read"], f"rank {rank} right after {call}")
        if rank == final_updates.leader_of(call):
            # Control: the leader's step was still pending before the call (its peer's
            # backward had not started).
            stale = overlap["stepped"]
            assert any(not torch.equal(stale[k], plain["stepped"][k]) for k in stale), call


def test_integrations_doc_accelerate_and_trainer_examples_are_the_tested_code():
    assert_doc_examples_run_in_tests("tests/accelerate_per_bucket.py")
