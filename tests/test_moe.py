"""moe_tiny: top-k routing math, and expert parallelism (all-to-all over the ``ep`` group) against
the same model run unsharded in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from overlapkit.train.models import GPT, MoE, MoEConfig, MoEGPT, shard_experts
from tests.multiproc import run_on_ranks

SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, n_expert=4, top_k=2)


def test_moe_layer_is_the_weighted_sum_of_each_tokens_top_k_experts():
    torch.manual_seed(0)
    layer = MoE(MoEConfig(**SMALL))
    x = torch.randn(3, 5, 16)
    got = layer(x)
    w1, w2 = layer.experts.w1, layer.experts.w2
    for b in range(3):
        for t in range(5):
            token = x[b, t]
            probs = (layer.router.weight @ token).softmax(dim=-1)
            top, chosen = probs.topk(2)
            expected = sum(
                p / top.sum() * (F.gelu(token @ w1[e]) @ w2[e])
                for p, e in zip(top, chosen, strict=True)
            )
            torch.testing.assert_close(got[b, t], expected, rtol=1e-5, atol=1e-6)


def test_every_expert_gets_a_gradient_even_without_tokens():
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, "n_expert": 8, "top_k": 1}))
    tokens = torch.zeros(1, 2, dtype=torch.long)  # 2 tokens cannot reach 8 experts
    GPT.loss(model(tokens), tokens).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_moe_config_names_the_invalid_field():
    with pytest.raises(ValueError, match=r"MoEConfig.top_k \(3\) must be <= n_expert \(2\)"):
        MoEConfig(n_expert=2, top_k=3)
    with pytest.raises(ValueError, match="MoEConfig.n_expert must be >= 1, got 0"):
        MoEConfig(n_expert=0)
    with pytest.raises(ValueError, match=r"MoEConfig.n_embd \(30\) must be divisible"):
        MoEConfig(n_embd=30, n_head=4)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 256, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _expert_parallel_matches_unsharded(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    reference = MoEGPT(MoEConfig(**SMALL))
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**SMALL))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    layers = shard_experts(model, mesh)

    inputs, targets = _inputs(rank)
    logits = model(inputs)
    GPT.loss(logits, targets).backward()

    # Unsharded, one process: this rank's logits and loss gradient, and the expert gradients
    # summed over every rank's loss (each rank's tokens reach the experts of all of them).
    ref_logits = reference(inputs)
    GPT.loss(ref_logits, targets).backward()
    own = {n: p.grad.clone() for n, p in reference.named_parameters()}
    reference.zero_grad()
    total = sum(GPT.loss(reference(_inputs(r)[0]), _inputs(r)[1]) for r in range(world_size))
    total.backward()

    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    local = 4 // world_size
    checked = 0
    for name, param in model.named_parameters():
        ref_param = dict(reference.named_parameters())[name]
        if isinstance(param, DTensor):
            assert name.endswith(("experts.w1", "experts.w2")), name
            rows = slice(rank * local, (rank + 1) * local)
            torch.testing.assert_close(param.to_local(), ref_param[rows].detach())
            torch.testing.assert_close(
                param.grad.to_local(), ref_param.grad[rows], rtol=1e-4, atol=1e-6
            )
        else:
            torch.testing.assert_close(param.grad, own[name], rtol=1e-4, atol=1e-6)
        checked += 1
    with pytest.raises(ValueError, match=r"parallel.plan.ep \(2\) must divide .*n_expert \(3\)"):
        shard_experts(MoEGPT(MoEConfig(**{**SMALL, "n_expert": 3})), mesh)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        shard_experts(GPT(MoEConfig(**SMALL)), mesh)
    dist.barrier()
    return {
        "checked": checked,
        "ranks": [layer.stats.ranks for layer in layers],
        "calls": [layer.stats.all_to_all_calls for layer in layers],
        "received": sum(layer.stats.tokens_received for layer in layers),
    }


@pytest.mark.slow
def test_expert_parallel_forward_and_backward_equal_the_unsharded_model():
    results = run_on_ranks(_expert_parallel_matches_unsharded, 2, total_timeout_s=150)
    for result in results:
        assert result["checked"] == len(list(MoEGPT(MoEConfig(**SMALL)).parameters()))
        assert result["ranks"] == [(0, 1), (0, 1)]
        # Per layer: dispatch and return in forward, the same two in backward.
        assert result["calls"] == [4, 4]
    # Each token row goes out and comes back, forward and backward: 16 tokens x top-2 x 2
    # layers x 4 all-to-alls, over both ranks.
    assert sum(r["received"] for r in results) == 2 * 16 * 2 * 2 * 4
