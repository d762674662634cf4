"""overlapkit-train's step (``overlapkit.train.run.loop.train_step``) driven in-process on a rank.

The tests that compare two ``parallel`` options run the trainer's own step with the real Hydra
config, a few steps each, inside a ``run_on_ranks`` child (no launcher, no checkpoints).
"""

from __future__ import annotations

import torch

TRAIN_SMALL = [  # overlapkit-train's MLP; grad_accum=2 runs the no-sync micro-step too
    "model=mlp",
    "model.config.width=32",
    "model.config.n_layer=3",
    "train.batch_size=8",
    "train.grad_accum=2",
    "train.steps=4",
    "optim.optimizer.lr=1e-2",
    "optim.scheduler.warmup_steps=1",
]
"""A few-second run's overrides (the train group's ``clip_grad_norm`` left as it is)."""


def compose_config(*overrides: str):
    """The trainer's config (``overlapkit.conf``) with ``overrides``."""
    # Hydra is imported where it is used: the CUDA tests' GPU host has none.
    from hydra import compose, initialize_config_module

    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def build_step(rank: int, *overrides: str, topology: str | None = None) -> dict:
    """What ``train_step`` takes, built from the config ``overrides`` on this rank: ``par``,
    ``optimizer``, ``scheduler``, ``stream``, ``source``, ``train_cfg``, the ``initial``
    parameters. With a ``topology`` (an ``ok.load_topology`` name) ``parallel.plan``'s layout
    is built on it (tp, ep); without one the wrapper runs over the whole world."""
    from hydra.utils import instantiate

    import overlapkit as ok
    from overlapkit.train.parallel.mesh import build_layout, split_parallel
    from overlapkit.train.parallel.wrappers import apply_parallel, check_run_optimizer
    from overlapkit.train.run.data import BatchStream

    cfg = compose_config(*overrides)
    train_cfg = instantiate(cfg.train)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    source = instantiate(cfg.data)
    plan, factory = split_parallel(cfg.parallel)
    check_run_optimizer(factory, plan=plan)
    make_optimizer = instantiate(cfg.optim.optimizer)
    layout = None
    if topology is not None:
        layout = build_layout(plan, ok.load_topology(topology), torch.device("cpu"))
    par = apply_parallel(
        model,
        instantiate(factory),
        layout,
        make_optimizer=make_optimizer,
        clip_grad_norm=train_cfg.clip_grad_norm,
    )
    optimizer = par.optimizer or make_optimizer(par.model.parameters())
    return {
        "par": par,
        "optimizer": optimizer,
        "scheduler": instantiate(cfg.optim.scheduler)(optimizer, total_steps=train_cfg.steps),
        "stream": BatchStream(source, rank=rank, batch_size=train_cfg.batch_size),
        "source": source,
        "train_cfg": train_cfg,
        "initial": initial,
    }


def train_steps(rank: int, *overrides: str) -> dict:
    """``train.steps`` steps of ``train_step`` with the config ``overrides``, on this rank.

    Returns:
        dict: per step ``losses`` and ``grad_norms`` (as the trainer logs them), the final
        ``params`` (full tensors), the ``initial`` ones, the wrapper's ``description``.
    """
    from overlapkit.train.run.loop import train_step

    built = build_step(rank, *overrides)
    par, optimizer, train_cfg = built["par"], built["optimizer"], built["train_cfg"]
    losses, grad_norms = [], []
    for _ in range(train_cfg.steps):
        loss, grad_norm = train_step(
            par, optimizer, built["stream"], built["source"], train_cfg, torch.device("cpu")
        )
        losses.append(loss)
        grad_norms.append(grad_norm)
        built["scheduler"].step()
    par.settle()
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in par.model.named_parameters()
        },
        "description": par.description,
        "initial": built["initial"],
    }
