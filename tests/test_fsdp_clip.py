"""``step_by_block(clip_grad_norm=)``: global-norm clipping folded into the block step equals
``clip_grad_norm_`` on the DTensor parameters and then ``optimizer.step()``, bitwise.

One 2-rank launch (FSDP) and one 4-rank launch (HSDP on a 2 x 2 mesh) run every scenario; the
tests read their results. The loss is scaled by 1 and 1e-3 on alternate steps, so the gradient
norm is above ``MAX_NORM`` on some steps (clipped) and below it on the others.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import overlapkit as ok
from overlapkit.fsdp import step_by_block
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks
from tests.test_fsdp_blocks import Block
from tests.test_fsdp_blocks import make_mlp as make_blocks
from tests.train_steps import TRAIN_SMALL, train_steps

VOCAB, DIM, HEADS, SEQ = 40, 32, 4, 8
LOSS_SCALES = (1.0, 1e-3, 1.0, 1e-3, 1.0)
MAX_NORM = 0.05  # between the norms of the two loss scales
NONFINITE_STEP = 1
TRAIN_MAX_NORM = 0.055  # its gradient norms are 0.053-0.075: clipped on some steps only


class _Net(nn.Module):
    """Embedding, attention blocks, final norm and head: the root owns parameters registered
    before and after the blocks, so ``model.parameters()`` order is not the block order."""

    def __init__(self, *, bf16_block: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        if bf16_block:  # its parameters and gradients are bf16; ok.fsdp computes all in bf16
            self.blocks[1].to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens, targets = torch.randint(0, VOCAB, (2, 4, SEQ), generator=g)
    return tokens, targets


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _train(mode, *, mesh=None, mixed=False, norm_type=2.0, max_norm=MAX_NORM, steps=4, inf_at=None):
    """``steps`` AdamW steps, clipped by ``clip_grad_norm_`` + ``optimizer.step()`` ("sync") or
    by ``step_by_block(clip_grad_norm=)`` ("folded"). ``inf_at=(step, rank)`` puts an inf in
    that rank's gradient shard at that step and asks for ``error_if_nonfinite``."""
    model = ok.fsdp(
        _Net(bf16_block=mixed), prefetch=1, mesh=mesh, mixed_precision="bf16" if mixed else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    rank = torch.distributed.get_rank()
    norms, errors = [], []
    for step in range(steps):
        tokens, targets = _batch(rank, step)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        (loss * LOSS_SCALES[step % len(LOSS_SCALES)]).backward()
        nonfinite = inf_at is not None and inf_at[0] == step
        if nonfinite and inf_at[1] == rank:
            model.blocks[2].proj.weight.grad.to_local()[0, 0] = float("inf")
        try:
            if mode == "sync":
                norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), max_norm, norm_type, error_if_nonfinite=nonfinite
                )
                norm = norm.full_tensor()
                opt.step()
            else:
                norm = step_by_block(
                    model,
                    opt,
                    clip_grad_norm=max_norm,
                    norm_type=norm_type,
                    error_if_nonfinite=nonfinite,
                )
            norms.append(norm)
        except RuntimeError as error:
            errors.append((step, str(error)))
        opt.zero_grad()
        sched.step()
    return {
        "norms": norms,
        "errors": errors,
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "optim": {
            str(k): {sk: _local(sv) for sk, sv in v.items()}
            for k, v in opt.state_dict()["state"].items()
        },
    }


def _event_order(rank, world_size):
    """With clipping on, the order ``step_by_block`` works in: each set clipped right before its
    update, the root's and block 0's next all-gathers before blocks 1-3 are clipped."""
    prefetch = importlib.import_module("overlapkit.fsdp.prefetch")
    per_block = importlib.import_module("overlapkit.optim.per_block")
    model = ok.fsdp(make_blocks(blocks=4, width=32), prefetch=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    owner = {id(p): f"block{i}" for i, b in enumerate(model) for p in b.parameters()}
    order = []

    def named(params):
        return sorted({owner.get(id(p), "root") for p in params} or {"root"})

    real_step, real_clip = per_block.step_subset, per_block.clip_subset_

    def step_spy(optimizer, params, **kwargs):
        order.append(("update", *named(params)))
        real_step(optimizer, params, **kwargs)

    def clip_spy(grads, coefficient):
        of_grad = {id(p.grad): p for p in model.parameters()}
        order.append(("clip", *named([of_grad[id(g)] for g in grads])))
        real_clip(grads, coefficient)

    for name, module in [("root", model), *((f"block{i}", b) for i, b in enumerate(model))]:
        real_unshard = module.unshard
        module.unshard = lambda *a, n=name, f=real_unshard, **k: (
            order.append(("gather", n)),
            f(*a, **k),
        )[1]
    per_block.step_subset, per_block.clip_subset_ = step_spy, clip_spy
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    norms = []
    try:
        for _ in range(2):
            model(x).square().mean().backward()
            order.clear()
            norms.append(prefetch.step_by_block(model, opt, clip_grad_norm=1e-3))
            opt.zero_grad()
    finally:
        per_block.step_subset, per_block.clip_subset_ = real_step, real_clip
    return {"order": order, "norms": norms}


def _fsdp_scenarios(rank, world_size):
    out = {}
    for norm_type, steps in [(2.0, 5), (float("inf"), 4), (1.0, 2), (3.0, 2)]:
        for mode in ("sync", "folded"):
            out[f"p={norm_type}", mode] = _train(mode, norm_type=norm_type, steps=steps)
    for mode in ("sync", "folded"):
        out["mixed fp32/bf16", mode] = _train(mode, mixed=True, steps=4)
        out["max_norm=0.0", mode] = _train(mode, max_norm=0.0, steps=2)
        out["error_if_nonfinite", mode] = _train(mode, steps=3, inf_at=(NONFINITE_STEP, 1))
    out["event_order"] = _event_order(rank, world_size)
    for clip in ("default", TRAIN_MAX_NORM):
        for option in ("fsdp", "fsdp_overlap"):
            overrides = [] if clip == "default" else [f"train.clip_grad_norm={clip}"]
            out["train", clip, option] = train_steps(
                rank, f"parallel={option}", *TRAIN_SMALL, *overrides
            )
    out["refusals"] = _refusals()
    return out


BAD_OPTIONS = {
    "negative max norm": ({"clip_grad_norm": -1.0}, ValueError, r"got -1\.0"),
    "max norm as a string": ({"clip_grad_norm": "1.0"}, TypeError, r"got '1\.0'"),
    "unknown norm type": ({"clip_grad_norm": 1.0, "norm_type": "two"}, TypeError, "'two'"),
    "error_if_nonfinite not a bool": (
        {"clip_grad_norm": 1.0, "error_if_nonfinite": "yes"},
        TypeError,
        "'yes'",
    ),
}


def _refusals():
    """Each bad clip option: the error, and whether any parameter changed."""
    model = ok.fsdp(make_blocks(blocks=2, width=16), prefetch=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 16)).sum().backward()
    before = [_local(p) for p in model.parameters()]
    found = {}
    for name, (options, _, _) in BAD_OPTIONS.items():
        try:
            step_by_block(model, opt, **options)
            found[name] = None
        except (TypeError, ValueError) as error:
            found[name] = (type(error), str(error))
    found["unchanged"] = all(
        torch.equal(_local(p), b) for p, b in zip(model.parameters(), before, strict=True)
    )
    return found


def _hsdp_scenarios(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for norm_type in (2.0, float("inf")):
        for mode in ("sync", "folded"):
            out[f"HSDP p={norm_type}", mode] = _train(
                mode, mesh=mesh, mixed=True, norm_type=norm_type, steps=4
            )
    return out


@pytest.fixture(scope="module")
def fsdp_results():
    return run_on_ranks(_fsdp_scenarios, 2, total_timeout_s=300)


@pytest.fixture(scope="module")
def hsdp_results():
    return run_on_ranks(_hsdp_scenarios, 4, total_timeout_s=300)


def _assert_bitwise(actual, expected, what):
    assert actual.keys() == expected.keys(), what
    for key, e in expected.items():
        a = actual[key]
        assert torch.equal(a, e), f"{what}[{key!r}] differs: max |diff| {(a - e).abs().max()}"


def _assert_same_run(results, case):
    for rank, result in enumerate(results):
        sync, folded = result[case, "sync"], result[case, "folded"]
        what = f"{case} (rank {rank})"
        # torch's message, after the API's name
        torch_errors = [(s, f"step_by_block: {m[0].lower()}{m[1:]}") for s, m in sync["errors"]]
        assert folded["errors"] == torch_errors, what
        assert len(folded["norms"]) == len(sync["norms"]) > 0, what
        for step, (a, e) in enumerate(zip(folded["norms"], sync["norms"], strict=True)):
            assert type(a) is torch.Tensor and a.dim() == 0, (what, type(a))
            assert torch.equal(a, e), f"{what}: norm of step {step}: {a.item()!r} != {e.item()!r}"
        _assert_bitwise(folded["params"], sync["params"], f"{what} params")
        for key, state in sync["optim"].items():
            _assert_bitwise(folded["optim"][key], state, f"{what} optimizer state {key}")
    norms = [n.item() for n in results[0][case, "sync"]["norms"]]
    return norms


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0, 3.0])
def test_folded_clip_equals_clip_grad_norm_then_step_bitwise(fsdp_results, norm_type):
    norms = _assert_same_run(fsdp_results, f"p={norm_type}")
    assert len(norms) == len({*norms}), norms  # every step has its own gradients
    if norm_type == 2.0:  # the loss scales put the norm above MAX_NORM on some steps only
        assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms


@pytest.mark.slow
def test_folded_clip_with_bf16_and_fp32_gradients_equals_clip_grad_norm_bitwise(fsdp_results):
    norms = _assert_same_run(fsdp_results, "mixed fp32/bf16")
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms
    dtypes = {p.dtype for p in fsdp_results[0]["mixed fp32/bf16", "folded"]["params"].values()}
    assert dtypes == {torch.float32, torch.bfloat16}


@pytest.mark.slow
def test_max_norm_zero_zeroes_gradients_as_torch(fsdp_results):
    _assert_same_run(fsdp_results, "max_norm=0.0")


@pytest.mark.slow
def test_nonfinite_norm_raises_on_every_rank_before_any_update(fsdp_results):
    _assert_same_run(fsdp_results, "error_if_nonfinite")
    for result in fsdp_results:  # the inf was on rank 1 only; the all-reduce tells rank 0
        [(step, message)] = result["error_if_nonfinite", "folded"]["errors"]
        assert step == NONFINITE_STEP and "is non-finite, so it cannot be clipped" in message


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_hsdp_folded_clip_equals_clip_grad_norm_bitwise(hsdp_results, norm_type):
    norms = _assert_same_run(hsdp_results, f"HSDP p={norm_type}")
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms


@pytest.mark.slow
def test_clipped_block_step_still_gathers_first_blocks_before_the_others_are_clipped(
    fsdp_results,
):
    for result in fsdp_results:
        norms = result["event_order"]["norms"]
        assert all(n.item() > 1e-3 for n in norms), norms  # clipping was active
        # prefetch=1: the root's and block 0's all-gathers start before blocks 1-3 are clipped.
        assert result["event_order"]["order"] == [
            ("clip", "root"),
            ("update", "root"),
            ("gather", "root"),
            ("clip", "block0"),
            ("update", "block0"),
            ("gather", "block0"),
            ("clip", "block1"),
            ("update", "block1"),
            ("clip", "block2"),
            ("update", "block2"),
            ("clip", "block3"),
            ("update", "block3"),
        ], result["event_order"]["order"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_clip_options_are_refused_naming_the_value_before_any_update(fsdp_results, name):
    _, error_type, pattern = BAD_OPTIONS[name]
    for result in fsdp_results:
        assert result["refusals"]["unchanged"]
        found = result["refusals"][name]
        assert found is not None, f"{name} was accepted"
        assert found[0] is error_type and found[1].startswith("step_by_block: "), found
        assert re.search(pattern, found[1]), found


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["default", TRAIN_MAX_NORM])
def test_train_fsdp_overlap_with_folded_clip_follows_parallel_fsdp_bitwise(fsdp_results, clip):
    for result in fsdp_results:
        sync, folded = result["train", clip, "fsdp"], result["train", clip, "fsdp_overlap"]
        assert "optimizer step by block" in folded["description"]
        assert folded["losses"] == sync["losses"]
        assert folded["grad_norms"] == sync["grad_norms"]  # what the trainer logs
        assert all(isinstance(n, float) for n in folded["grad_norms"]), folded["grad_norms"]
        for name, before in folded["initial"].items():  # every parameter was updated
            assert not torch.equal(folded["params"][name], before), name
        _assert_bitwise(folded["params"], sync["params"], f"train clip={clip} params")
    norms = fsdp_results[0]["train", clip, "fsdp"]["grad_norms"]
    if clip != "default":
        assert any(n > clip for n in norms) and any(n < clip for n in norms), norms


def _cuda_run(mode, optimizer, mixed):
    """5 clipped steps on one GPU, "sync" (clip_grad_norm_ + step) or "folded"."""
    mesh = init_device_mesh("cuda", (1,))
    model = ok.fsdp(
        _Net(bf16_block=mixed).cuda(),
        prefetch=1,
        mesh=mesh,
        mixed_precision="bf16" if mixed else None,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{optimizer: True})
    norms = []
    for step in range(5):
        tokens, targets = (t.cuda() for t in _batch(0, step))
        loss = nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        (loss * LOSS_SCALES[step]).backward()
        if mode == "sync":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor())
            opt.step()
        else:
            torch.cuda.set_sync_debug_mode("error")  # no host sync inside the clipped step
            try:
                norms.append(step_by_block(model, opt, clip_grad_norm=MAX_NORM))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    state = {
        f"{k}.{sk}": _local(sv)
        for k, v in opt.state_dict()["state"].items()
        for sk, sv in v.items()
    }
    return norms, {n: _local(p) for n, p in model.named_parameters()}, state


@requires_cuda
@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-block"])
def test_cuda_folded_clip_equals_clip_grad_norm_then_step_bitwise(optimizer, mixed):
    torch.distributed.init_process_group(
        "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        sync = _cuda_run("sync", optimizer, mixed)
        folded = _cuda_run("folded", optimizer, mixed)
    finally:
        torch.distributed.destroy_process_group()
    norms = [n.item() for n in sync[0]]
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms
    for a, e in zip(folded[0], sync[0], strict=True):
        assert a.is_cuda and torch.equal(a, e), (a, e)
    _assert_bitwise(folded[1], sync[1], "params")
    _assert_bitwise(folded[2], sync[2], "optimizer state")
