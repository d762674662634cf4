"""Small models, deterministic data and single-process reference gradients for DDP-style tests.

A data-parallel step on R ranks, each with the mean loss over its own equal-sized batch, must give
every rank the gradient of the mean loss over the concatenated batch: that is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 16
OUT_FEATURES = 4


def make_mlp(seed: int = 0, hidden: int = 32, layers: int = 3) -> nn.Sequential:
    """An MLP whose initial weights depend only on ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(IN_FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, OUT_FEATURES))
    return nn.Sequential(*mods)


def make_batches(steps: int, world_size: int, per_rank: int = 8, seed: int = 1):
    """``steps`` global batches ``(x, y)`` of ``world_size * per_rank`` rows each."""
    g = torch.Generator().manual_seed(seed)
    n = world_size * per_rank
    return [
        (torch.randn(n, IN_FEATURES, generator=g), torch.randn(n, OUT_FEATURES, generator=g))
        for _ in range(steps)
    ]


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int):
    """Rank ``rank``'s contiguous slice of a global batch."""
    x, y = batch
    per_rank = x.shape[0] // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def reference_grads(model: nn.Module, batches, lr: float = 0.1) -> list[dict[str, torch.Tensor]]:
    """Per step, the gradients of the mean MSE over the whole batch; SGD(lr) between steps."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return out


def batch_grads(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    world_size: int,
) -> dict[str, torch.Tensor]:
    """The gradients of the mean MSE over ``batch`` at ``params``, in one process (``model`` is
    overwritten).

    The forward runs shard by shard, as the ranks run it: a matmul over 8 rows and one over 16
    can round a pre-activation differently, and one that sits at ReLU's kink then takes the other
    branch, a difference in the gradient no reduction made.
    """
    model.load_state_dict(params)
    model.zero_grad(set_to_none=True)
    losses = [nn.functional.mse_loss(model(x), y) for x, y in
              (shard(batch, rank, world_size) for rank in range(world_size))]  # fmt: skip
    (sum(losses) / world_size).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name → a copy of each parameter, without DDP's ``module.`` prefix."""
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Name → a copy of each gradient (None stays None), without DDP's ``module.`` prefix."""
    return {
        n.removeprefix("module."): (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
    }


def assert_bitwise(actual, expected, what: str) -> None:
    """``torch.equal`` through nested dicts/lists of tensors (NaN equal to NaN); else ``==``."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), what
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{what}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise(a, e, f"{what}[{k}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, what
        diff = (actual.float() - expected.float()).abs().max()
        same = torch.equal(actual, expected) or (
            torch.equal(actual.isnan(), expected.isnan())
            and torch.equal(actual.nan_to_num(), expected.nan_to_num())
        )
        assert same, f"{what} differs: max |diff| {diff}"
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"
