"""Chunked expert parallelism (``parallel.plan.ep_chunks``): every chunk count against one process
running the unsharded model and against the synchronous dispatch (``ep_chunks=1``), in one
launch of 2 gloo ranks; the pipelining order; the config key and its refusals."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit.inlayer.chunked_ep import DispatchStats, dispatch_combine
from overlapkit.train.models import GPT, GPTConfig, MoEConfig, MoEGPT
from overlapkit.train.parallel.mesh import PlanConfig, build_layout
from overlapkit.train.parallel.run_layout import check_parallel
from overlapkit.train.parallel.wrappers import apply_parallel, clip_grad_norm
from overlapkit.train.run.loop import TrainConfig
from tests.cuda import NCCL_ONE_HOST_ENV, nccl_rank_device, requires_cuda
from tests.multiproc import run_on_ranks

MOE_SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, n_expert=4, top_k=2)
CHUNKS = (1, 2, 3)
STEPS, LR, MAX_NORM = 3, 1e-2, 0.05


def _experts(w: torch.Tensor, log: list, stats: DispatchStats):
    """Local experts ``rows @ w[e]``; logs the exchanges started when each chunk's experts run
    forward and when their backward starts."""

    def run(rows: torch.Tensor, counts) -> torch.Tensor:
        log.append(("forward", stats.all_to_all_calls))
        out = torch.cat([r @ w[e] for e, r in enumerate(torch.split(rows, list(counts)))])
        if out.requires_grad:
            out.register_hook(lambda g: log.append(("backward", stats.all_to_all_calls)))
        return out

    return run


def _exchanges_equal_local(rank: int, ep: int) -> dict:
    """``dispatch_combine`` for every chunk count against every expert run locally, and the
    order its exchanges start in (forward and backward)."""
    n_expert, local = 6, 3
    g = torch.Generator().manual_seed(7)
    weights = torch.randn(n_expert, 5, 4, generator=g)
    x = torch.randn(2, 11, 5, generator=g)[rank].requires_grad_()
    expert_of = torch.randint(0, n_expert - 1, (2, 11), generator=g)[rank]  # expert 5: no rows
    ref_w = weights.clone().requires_grad_()
    ref = dispatch_combine(x, expert_of, n_expert, _experts(ref_w, [], DispatchStats()), group=None)
    ref_gx, ref_gw = torch.autograd.grad((ref * ref).sum(), (x, ref_w))
    orders = {}
    for chunks in (1, 2, 3, 11):
        w = weights[rank * local : (rank + 1) * local].clone().requires_grad_()
        stats, log = DispatchStats(), []
        out = dispatch_combine(
            x, expert_of, n_expert, _experts(w, log, stats), group=dist.group.WORLD,
            chunks=chunks, stats=stats,
        )  # fmt: skip
        gx, gw = torch.autograd.grad((out * out).sum(), (x, w))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
        # Each rank's expert gradient sums both ranks' rows; the reference saw only this rank's.
        total = torch.zeros_like(ref_gw)
        total[rank * local : (rank + 1) * local] = gw
        dist.all_reduce(total)
        own = ref_gw.clone()
        dist.all_reduce(own)
        torch.testing.assert_close(total, own, rtol=1e-5, atol=1e-5)
        orders[chunks] = (log, stats.all_to_all_calls)
    with pytest.raises(ValueError, match=r"ep_chunks=12 must be between 1 and the rows"):
        dispatch_combine(x, expert_of, n_expert, None, group=dist.group.WORLD, chunks=12)
    return orders


def _batch(shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10 + shard))
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Module, step_grads) -> tuple[list[float], list[dict]]:
    """AdamW with clipping for ``STEPS`` steps; per step the loss and the gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        losses.append(step_grads(step))
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        clip_grad_norm(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _training_equals_one_process(rank: int, world_size: int) -> dict:
    """ep=2 training with each ``ep_chunks`` against one process training the unsharded model
    on both ranks' batches (the mean loss), and against ``ep_chunks=1``."""
    topology = ok.load_topology("cpu-gloo")
    torch.manual_seed(0)
    reference = MoEGPT(MoEConfig(**MOE_SMALL))

    def reference_step(step: int) -> float:
        loss = sum(GPT.loss(reference(_batch(s)[0]), _batch(s)[1])
                   for s in range(world_size)) / world_size  # fmt: skip
        loss.backward()
        return loss.item()

    ref_losses, ref_grads = _train(reference, reference_step)
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    runs = {}
    for chunks in CHUNKS:
        torch.manual_seed(0)
        model = MoEGPT(MoEConfig(**MOE_SMALL))
        layout = build_layout(PlanConfig.of(ep=2, ep_chunks=chunks), topology, torch.device("cpu"))
        par = apply_parallel(model, functools.partial(ok.GradBucketer), layout)

        def step_grads(step: int, par=par) -> float:
            inputs, targets = _batch(rank)  # the same batches every step: the loss falls
            loss = GPT.loss(par.model(inputs), targets)
            loss.backward()
            par.finish_backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            return mean.item() / world_size

        losses, grads = _train(par.model, step_grads)
        params = {n: _full(p).detach() for n, p in par.model.named_parameters()}
        runs[chunks] = (losses, grads, params)
        calls = [m.stats.all_to_all_calls for m in model.moe_layers()]
        assert calls == [4 * chunks * STEPS] * 2, calls  # dispatch + combine, both directions
        dist.barrier()
    for chunks, (losses, grads, params) in runs.items():
        for against, (want_losses, want_grads, want_params) in (
            ("one process", (ref_losses, ref_grads, ref_params)),
            ("ep_chunks=1", runs[1]),
        ):
            what = f"ep_chunks={chunks} vs {against}"
            assert losses == pytest.approx(want_losses, abs=1e-5), what
            for step in range(STEPS):
                for name, grad in grads[step].items():
                    torch.testing.assert_close(
                        grad, want_grads[step][name], rtol=1e-5, atol=1e-5,
                        msg=lambda m, n=name, s=step, w=what: f"{w} step {s} {n}: {m}",
                    )  # fmt: skip
            for name, param in params.items():
                torch.testing.assert_close(
                    param, want_params[name], rtol=1e-5, atol=1e-5,
                    msg=lambda m, n=name, w=what: f"{w} {n}: {m}",
                )  # fmt: skip
    return {"losses": ref_losses}


def _every_case(rank: int, world_size: int) -> dict:
    return {
        "exchanges": _exchanges_equal_local(rank, world_size),
        "training": _training_equals_one_process(rank, world_size),
    }


@pytest.mark.slow
def test_every_chunk_count_equals_one_process_and_the_synchronous_dispatch():
    results = run_on_ranks(_every_case, 2, total_timeout_s=150)
    for result in results:
        for chunks, (log, calls) in result["exchanges"].items():
            assert calls == 4 * chunks
            forward = [n for kind, n in log if kind == "forward"]
            backward = [n for kind, n in log if kind == "backward"]
            # Chunk k's experts run once chunk k+1's dispatch and chunk k-1's combine started.
            assert forward == [min(k + 2, chunks) + k for k in range(chunks)]
            # Backward, last chunk first: every combine gradient started at once, chunk k+1's
            # dispatch gradient before chunk k's expert backward.
            assert backward == [2 * chunks + chunks + (chunks - 1 - k) for k in reversed(
                range(chunks))]  # fmt: skip
        assert result["training"]["losses"][-1] < result["training"]["losses"][0]


@pytest.mark.parametrize(
    ("plan", "batch", "message"),
    [
        (dict(ep_chunks=2), 2, r"ep_chunks=2 pipelines expert parallelism's .*ep is 1"),
        (dict(ep=2, ep_chunks=17), 2, r"ep_chunks=17 must be at most the tokens .* = 16\)"),
    ],
)
def test_ep_chunks_that_cannot_run_are_refused_in_one_line(plan, batch, message):
    with pytest.raises(ValueError, match=message):
        check_parallel(
            PlanConfig.of(**plan),
            {"_target_": "overlapkit.GradBucketer"},
            TrainConfig(batch_size=batch),
            world_size=4,
            model_config=MoEConfig() if "ep" in plan else GPTConfig(),
            seq_len=8,
        )


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_ep_chunks_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"parallel.plan.ep_chunks must be an integer >= 1"):
        PlanConfig.of(ep=2, ep_chunks=value)
    assert PlanConfig.of(ep=2).ep_chunks == 1


def test_ep_dp_declares_the_ep_chunks_default():
    from importlib.resources import files

    from omegaconf import OmegaConf

    declared = OmegaConf.load(files("overlapkit.conf") / "parallel" / "ep_dp.yaml").parallel.plan
    assert declared.ep_chunks == 1 == PlanConfig.of(**declared).ep_chunks


def _nccl_chunks_match_sync(rank: int, world_size: int) -> dict[int, int]:
    """Every chunk count on NCCL against ``chunks=1``; per chunk count, the host syncs of one
    forward and backward (``set_sync_debug_mode("warn")`` warns once per sync)."""
    import warnings

    device = nccl_rank_device(rank, world_size)
    n_expert, local = 4, 2
    g = torch.Generator().manual_seed(3 + rank)
    weights = torch.randn(local, 16, 8, generator=g).to(device)
    x = torch.randn(64, 16, generator=g).to(device).requires_grad_()
    expert_of = torch.randint(0, n_expert, (64,), generator=g).to(device)

    def experts(rows: torch.Tensor, counts) -> torch.Tensor:
        return torch.cat(
            [r @ w_e for r, w_e in zip(torch.split(rows, list(counts)), w, strict=True)]
        )

    results, syncs = {}, {}
    for chunks in (1, 2, 4):
        w = weights.clone().requires_grad_()
        dispatch_combine(x, expert_of, n_expert, experts, group=dist.group.WORLD, chunks=chunks)
        with warnings.catch_warnings(record=True) as caught:  # the first pass set NCCL up
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = dispatch_combine(
                    x, expert_of, n_expert, experts, group=dist.group.WORLD, chunks=chunks
                )
                grads = torch.autograd.grad(out.square().sum(), (x, w))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[chunks] = sum("synchroniz" in str(c.message) for c in caught)
        results[chunks] = (out.detach(), *grads)
    for chunks, got in results.items():
        for a, b in zip(got, results[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"chunks={chunks}")
    return syncs


@requires_cuda
@pytest.mark.timeout(600)
def test_cuda_chunked_dispatch_equals_sync_with_no_host_sync_per_chunk():
    results = run_on_ranks(
        _nccl_chunks_match_sync,
        2,
        collective_timeout_s=120,
        total_timeout_s=560,
        env=NCCL_ONE_HOST_ENV,
        backend="nccl",
    )
    for syncs in results:
        # The split sizes once per layer, whatever the chunks (none per chunk).
        assert syncs[2] == syncs[4] == syncs[1], syncs
