"""A real ``lightning.Trainer`` on two gloo ranks: OverlapDDPStrategy; ok.fsdp in configure_model.

Each rank runs as under torchrun (``LOCAL_RANK`` set, so Lightning launches nothing itself and
uses the process group that is already there). One spawn fits with the same model and data:
Lightning's own ``DDPStrategy`` (the reference), ``strategy="overlapkit_ddp"`` (fp32),
``OverlapDDPStrategy(compress="bf16")`` and ``ModelParallelStrategy`` + ``ok.fsdp``; then the
per-bucket fits of ``tests/lightning_per_bucket.py`` (``OverlapDDPStrategy(optimizer_overlap=True)``
against ``DDPStrategy``, bitwise).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning", reason="the integrations extra is not installed")

from tests import lightning_per_bucket as per_bucket
from tests.doc_examples import assert_doc_examples_run_in_tests
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise
from tests.test_fsdp_blocks import make_mlp

STEPS = 3
PER_RANK = 4
WIDTH = 64
# bf16 keeps 8 significant bits; the gradient is rounded once per all-reduce (2**-9 relative)
# and the SGD step moves parameters by lr x gradient, so after three steps the parameters differ
# from fp32 DDP by far less than lr x 3 x 2**-8 x max|grad| (~1e-4 here).
BF16_PARAM_TOL = 1e-3


def _fit(strategy, fsdp: bool = False) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    import overlapkit as ok
    from overlapkit.integrations.lightning import OverlapDDPStrategy

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_mlp(blocks=4, width=WIDTH)
            self.grads: list[dict[str, torch.Tensor]] = []

        def configure_model(self):
            if fsdp:
                ok.fsdp(self.net, mesh=self.device_mesh["data_parallel"], prefetch=1)

        def training_step(self, batch, _batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def forward(self, x):
            return self.net(x)

        def on_before_optimizer_step(self, _optimizer):
            # Gradients here are what DDP/FSDP reduced (FSDP: this rank's shard, made full).
            self.grads.append(
                {
                    n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                    for n, p in self.named_parameters()
                }
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(5)
    n = 2 * PER_RANK * STEPS
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    model = Net()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=PER_RANK))
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    overlap = isinstance(strategy, OverlapDDPStrategy) or strategy == "overlapkit_ddp"
    # Lightning has unwrapped the DDP model at teardown: what it holds is the LightningModule.
    assert trainer.strategy.model is model
    stats = ok.comm_stats(trainer.strategy.model) if overlap else None
    return {
        "grads": model.grads,
        "params": params,
        "records": len(stats.records) if stats else 0,
        "buckets": len(stats.by_bucket()) if stats else 0,
    }


def _all_fits(rank: int, world_size: int, root: str) -> dict:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from overlapkit.integrations.lightning import OverlapDDPStrategy

    try:
        OverlapDDPStrategy(ddp_comm_hook=lambda *a: None)
        hook_error = None
    except ValueError as e:
        hook_error = str(e)
    return {
        "plain": _fit(DDPStrategy()),
        # By name, as a user writes it after importing the integration.
        "overlap": _fit("overlapkit_ddp"),
        "bf16": _fit(OverlapDDPStrategy(compress="bf16", bucket_mb=0.02)),
        "fsdp": _fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), True),
        "hook_error": hook_error,
        "per_bucket": per_bucket.scenarios(root),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # Lightning reads the torchrun-style environment run_on_ranks sets (LOCAL_RANK, RANK...).
    root = str(tmp_path_factory.mktemp("lightning"))
    return run_on_ranks(_all_fits, 2, root, total_timeout_s=300, collective_timeout_s=60)


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_overlapkit_ddp_strategy_matches_lightning_ddp(two_ranks):
    for result in two_ranks:
        plain, overlap = result["plain"], result["overlap"]
        assert len(overlap["grads"]) == STEPS
        for got, want in zip(overlap["grads"], plain["grads"], strict=True):
            assert _max_diff(got, want) < 1e-6
        assert _max_diff(overlap["params"], plain["params"]) < 1e-6
        # ok.ddp's instrumented hook ran: at least one bucket record per step.
        assert overlap["records"] >= STEPS
    # Data parallel: both ranks hold the same parameters.
    assert _max_diff(two_ranks[0]["overlap"]["params"], two_ranks[1]["overlap"]["params"]) == 0


@pytest.mark.slow
def test_bf16_compression_works_on_gloo_under_lightning(two_ranks):
    for result in two_ranks:
        bf16, plain = result["bf16"], result["plain"]
        diff = _max_diff(bf16["params"], plain["params"])
        assert 0 < diff < BF16_PARAM_TOL  # compressed (not bitwise fp32), yet close
        assert bf16["buckets"] > 1  # bucket_mb=0.02 splits the 66 KB of gradients
        # DDP reduces the first step in one bucket and rebuilds its buckets after it.
        assert bf16["records"] == 1 + (STEPS - 1) * bf16["buckets"]


@pytest.mark.slow
def test_ok_fsdp_in_configure_model_matches_lightning_ddp(two_ranks):
    for result in two_ranks:
        assert _max_diff(result["fsdp"]["params"], result["plain"]["params"]) < 1e-5


@pytest.mark.slow
def test_strategy_refuses_a_second_comm_hook(two_ranks):
    message = two_ranks[0]["hook_error"]
    assert message is not None and "ddp_comm_hook" in message


# -- OverlapDDPStrategy(optimizer_overlap=True), against DDPStrategy (tests/lightning_per_bucket.py)


def _trained(result: dict) -> dict:
    return {"params": result["params"], "optim": result["optim"], "norms": result["norms"]}


@pytest.mark.slow
def test_per_bucket_strategy_trains_bitwise_as_lightning_ddp_with_clipping_and_accumulation(
    two_ranks,
):
    for rank, result in enumerate(two_ranks):
        plain, overlap = result["per_bucket"]["plain"], result["per_bucket"]["per_bucket"]
        assert_bitwise(_trained(overlap), _trained(plain), f"rank {rank}")
        # The sample under inference_mode right after `extra`'s first update saw it applied,
        # and the optimizer state that update created there is no inference tensor.
        assert_bitwise(overlap["inference"], plain["inference"], f"rank {rank} inference")
        assert not overlap["inference_state"]
        assert overlap["global_step"] == per_bucket.STEPS
    assert_bitwise(
        two_ranks[1]["per_bucket"]["per_bucket"]["params"],
        two_ranks[0]["per_bucket"]["per_bucket"]["params"],
        "ranks",
    )


@pytest.mark.slow
def test_per_bucket_strategy_builds_no_ddp_and_steps_the_bucketer_once_per_optimizer_step(
    two_ranks,
):
    for result in two_ranks:
        plain, overlap = result["per_bucket"]["plain"], result["per_bucket"]["per_bucket"]
        assert plain["ddp"] == [True] * per_bucket.STEPS  # the reference is DDP
        assert overlap["ddp"] == [False] * per_bucket.STEPS
        assert overlap["bucketer_steps"] == list(range(per_bucket.STEPS))


@pytest.mark.slow
def test_lightning_clipping_was_active_on_some_steps_only_and_matters(two_ranks):
    result = two_ranks[0]["per_bucket"]
    norms = [float(n) for n in result["plain"]["norms"]]
    assert any(n > per_bucket.MAX_NORM for n in norms), norms
    assert any(n < per_bucket.MAX_NORM for n in norms), norms
    # Control: the same per-bucket fit without clipping ends elsewhere.
    unclipped, plain = result["per_bucket_unclipped"]["params"], result["plain"]["params"]
    assert any(not torch.equal(unclipped[k], plain[k]) for k in plain)


@pytest.mark.slow
def test_parameters_read_between_step_and_forward_need_synchronize(two_ranks):
    for rank, result in enumerate(two_ranks):
        plain = result["per_bucket"]["plain"]["snapshots"]["synchronized"]
        snapshots = result["per_bucket"]["per_bucket"]["snapshots"]
        assert_bitwise(snapshots["synchronized"], plain, f"rank {rank}")
        # Control: read directly after the step, the updates are still pending.
        stale = snapshots["unsynchronized"]
        assert any(not torch.equal(stale[k], plain[k]) for k in plain)


@pytest.mark.slow
def test_checkpoint_saved_mid_run_equals_ddps_and_resumes_in_the_other_form(two_ranks):
    for rank, result in enumerate(two_ranks):
        saved = result["per_bucket"]["checkpoints"]
        assert_bitwise(saved["per_bucket"], saved["plain"], f"rank {rank} checkpoint")
        resumed = result["per_bucket"]["resumed"]
        reference = _trained(resumed["plain", "plain"])
        for form, by in (("per_bucket", "plain"), ("plain", "per_bucket")):
            assert_bitwise(_trained(resumed[form, by]), reference, f"rank {rank} {form}<-{by}")
        # The resumed fit's own bucketer, numbering its steps from 0.
        steps = per_bucket.STEPS - per_bucket.CHECKPOINT_EVERY
        assert resumed["per_bucket", "plain"]["bucketer_steps"] == list(range(steps))


@pytest.mark.slow
def test_16_mixed_grad_scaler_skips_the_same_steps_as_lightning_ddp(two_ranks):
    for rank, result in enumerate(two_ranks):
        plain, overlap = (
            result["per_bucket"]["fp16"]["plain"],
            result["per_bucket"]["fp16"]["per_bucket"],
        )
        assert_bitwise(_trained(overlap), _trained(plain), f"rank {rank}")
        assert overlap["scales"] == plain["scales"]
        # Some steps overflowed (the scale backed off, the norm is not finite), others did not.
        scales = [per_bucket.FP16_INIT_SCALE, *overlap["scales"]]
        assert any(b < a for a, b in itertools.pairwise(scales)), scales
        finite = [math.isfinite(float(n)) for n in overlap["norms"]]
        assert any(finite) and not all(finite), overlap["norms"]


@pytest.mark.slow
def test_per_bucket_strategy_refuses_what_it_cannot_train_as_ddp(two_ranks):
    result = two_ranks[0]["per_bucket"]
    assert "['compress']" in result["compress_refused"]
    refused = result["refused"]
    assert "gradient_clip_algorithm='value'" in refused["value_clip"]
    assert "manual optimization" in refused["manual"]
    assert "'net.1.num_batches_tracked' changed during training" in refused["batch_norm"]


def test_integrations_doc_lightning_examples_are_the_tested_code():
    assert_doc_examples_run_in_tests("tests/lightning_per_bucket.py")
