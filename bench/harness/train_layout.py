"""A layout run as overlapkit-train runs it, its step timed by phases, and its planner layout.

``bench.planner_ranking`` composes each layout's config from overlapkit-train's own groups
(``compose_run``), prices it as the run prices itself (``planned_layout``:
``overlapkit.train.parallel.run_layout``) and steps it with the loop's own wrapping and step
(``layout_run``: ``overlapkit.train.run.step.wrap_model`` and ``train_step``), timing the
``PHASES`` of each step on this rank (``PhaseClock``).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig

from overlapkit.layout import TrainingLayout
from overlapkit.topology import Topology
from overlapkit.train.parallel.mesh import build_layout, split_parallel
from overlapkit.train.parallel.run_layout import run_layout
from overlapkit.train.parallel.wrappers import Parallelized
from overlapkit.train.run.data import BatchStream
from overlapkit.train.run.step import train_step, wrap_model

CPU = torch.device("cpu")


def compose_run(overrides: list[str]) -> DictConfig:
    """overlapkit-train's config (``overlapkit/conf``) with ``overrides``."""
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def planned_layout(config: DictConfig, world_size: int) -> TrainingLayout:
    """The layout a run of ``config`` prices itself with (``train.parallel.run_layout``)."""
    plan, factory_cfg = split_parallel(config.parallel)
    layout = run_layout(plan, factory_cfg, instantiate(config.train), world_size=world_size)
    if layout is None:
        raise ValueError(f"the planner has no layout for parallel={dict(config.parallel)}")
    return layout


PHASES = ("forward", "backward", "finish_backward", "optimizer")
"""A step's parts on one rank: the model's forwards (0 under a pipeline, whose schedule calls
the stages), the rest until the wrapper's end-of-backward (the backwards and losses; the whole
schedule under a pipeline), that end-of-backward, and the rest (the optimizer step)."""


class PhaseClock:
    """Times the ``PHASES`` of ``train_step`` on ``par`` (hooks on its model, a timed
    ``finish_backward``); ``par`` is what the step then runs."""

    def __init__(self, par: Parallelized):
        self.forward_s = 0.0
        self.finish = (0.0, 0.0)
        self._entered = 0.0
        self._finish_backward = par.finish_backward
        par.model.register_forward_pre_hook(self._enter)
        par.model.register_forward_hook(self._leave)
        self.par = dataclasses.replace(par, finish_backward=self._timed_finish)

    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        self._entered = time.perf_counter()

    def _leave(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self.forward_s += time.perf_counter() - self._entered

    def _timed_finish(self) -> None:
        start = time.perf_counter()
        self._finish_backward()
        self.finish = (start, time.perf_counter())

    def phases(self, start: float, end: float) -> list[float]:
        """The last step's ``PHASES`` (s) given its start and end; resets the forward sum."""
        forward, self.forward_s = self.forward_s, 0.0
        begin, done = self.finish
        return [forward, begin - start - forward, done - begin, end - done]


@dataclasses.dataclass
class LayoutRun:
    """One layout as overlapkit-train runs it on this rank."""

    clock: PhaseClock
    optimizer: torch.optim.Optimizer
    stream: BatchStream
    source: object
    train_cfg: object
    split: object
    description: str
    """What overlapkit-train's log line says the run is (its wrapper, cp, recomputation)."""

    def step(self) -> list[float]:
        """One ``train_step``; its ``PHASES`` on this rank (s)."""
        start = time.perf_counter()
        train_step(
            self.clock.par,
            self.optimizer,
            self.stream,
            self.source,
            self.train_cfg,
            CPU,
            self.split,
        )
        return self.clock.phases(start, time.perf_counter())


def layout_run(config: DictConfig, topology: Topology) -> LayoutRun:
    """The model, wrapping, optimizer and data of ``config``, as ``overlapkit.train.run.loop.train``
    builds them (a collective)."""
    train_cfg = instantiate(config.train)
    torch.manual_seed(train_cfg.seed)  # the same initial weights on every rank
    model = instantiate(config.model)
    source = instantiate(config.data)
    plan, factory_cfg = split_parallel(config.parallel)
    layout = build_layout(plan, topology, CPU)
    make_optimizer = instantiate(config.optim.optimizer)
    par, split, recomputed = wrap_model(
        model,
        plan,
        factory_cfg,
        layout,
        train_cfg,
        loss_fn=source.loss,
        make_optimizer=make_optimizer,
        device=CPU,
    )
    optimizer = par.optimizer or make_optimizer(par.model.parameters())
    index, _ = layout.data_shard(dist.get_rank(), dist.get_world_size())
    stream = BatchStream(source, rank=index, batch_size=train_cfg.batch_size)
    description = par.description + split.description
    if recomputed:
        description += f", recompute={train_cfg.recompute} ({len(recomputed)} blocks)"
    return LayoutRun(PhaseClock(par), optimizer, stream, source, train_cfg, split, description)
