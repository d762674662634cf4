"""``parallel=auto``: the auto-planner chooses the run's layout; the run records it and keeps it.

Before any worker starts, ``overlapkit-train parallel=auto`` asks ``ok.plan(topology,
model=..., global_batch=..., seq_len=..., auto=True, framework="overlapkit-train")`` for the
run's model (``autoplan.models.train_model_spec``), global batch, sequence length and topology,
turns the winner into the overrides ``overlapkit plan --auto`` prints for it
(``autoplan.handoff.run_config.train_overrides``: a ``parallel`` group, its ``parallel.plan`` sizes,
``train.batch_size``, ``train.grad_accum``, ``train.recompute``) and composes the run's config
again with them in place of ``parallel=auto``: the run is exactly the one that ``run it:`` line
starts, checked before launch like any other.

- **Global batch**: ``parallel.global_batch`` sequences per step; null (the default) keeps what
  the config's ``train.batch_size x train.grad_accum`` is over the world as plain data
  parallelism.
- **Pins**: ``parallel.pins`` holds ``ok.plan``'s pins (``+parallel.pins.tp=2``,
  ``+parallel.pins.sharding=fsdp``, ``+parallel.pins.recompute=full:2``): the search keeps them.
- **Topology**: the planner needs the accelerator section of a topology file
  (``topology=preset topology.name_or_path=FILE``): a GPU preset, or on a CPU host the file
  ``overlapkit calibrate --host`` writes. ``topology=detect`` describes the ranks only once they
  run, and without an accelerator, so it is refused by name.
- **Kept across restarts**: the choice is written to ``<run dir>/planned_layout.json`` with the
  request it answered. A torch elastic restart reuses the same job, and a rerun of the command
  (a resumed run) reads the file and runs that layout without planning again, so a checkpoint is
  always resumed into the layout that wrote it; a rerun whose request differs (model, batch,
  sequence length, world size, topology, pins) is refused with both named. On several nodes each
  node plans alike (the same inputs give the same answer); node 0 keeps the record.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from overlapkit.autoplan.candidate import layout_dict, layout_from_dict
from overlapkit.autoplan.handoff.run_config import batch_overrides, parallel_group, plan_overrides
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.ok_plan import auto_plan
from overlapkit.autoplan.pins import pins_from
from overlapkit.autoplan.settings import PlanSearchError
from overlapkit.layout import PartialLayout, TrainingLayout
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

RECORD_NAME = "planned_layout.json"
"""The file in the run directory that keeps the layout ``parallel=auto`` chose."""
DETECT = "overlapkit.topology.detect_topology"
REPLACED = ("parallel", "train.batch_size", "train.grad_accum", "train.recompute")
"""Overrides the winner's replace (``train.recompute`` covers ``train.recompute_layers``)."""


@dataclass(kw_only=True, slots=True)
class AutoConfig:
    """The ``parallel=auto`` group (``conf/parallel/auto.yaml``)."""

    auto: bool = True
    global_batch: int | None = None
    """Sequences per step; None: ``train.batch_size x train.grad_accum x`` the world size."""
    pins: dict[str, Any] = field(default_factory=dict)
    """``ok.plan``'s pins (``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``dp_shard``, ``micro_batch``,
    ``virtual_stages``, ``recompute``, ``recompute_layers``, ``sharding``), as written (the
    record keeps them so); checked as a ``PartialLayout`` (``fixed``)."""

    def __post_init__(self) -> None:
        if self.global_batch is not None:
            check_int("parallel.global_batch", self.global_batch, 1)
        self.pins = dict(self.pins)
        self.fixed()  # a bad pin is refused here, by its config key

    def fixed(self) -> PartialLayout:
        """The pins as the search takes them.

        Raises:
            TypeError / ValueError: a bad pin, named ``parallel.pins.<key>``.
        """
        return pins_from(self.pins, spell=lambda key: f"parallel.pins.{key}")


def is_auto(parallel: Mapping[str, Any]) -> bool:
    """Whether the ``parallel`` group is ``parallel=auto``."""
    return bool(parallel.get("auto", False))


@dataclass(frozen=True, slots=True)
class AutoRequest:
    """What the planner is asked; a recorded layout is reused only for the same request."""

    model: str
    global_batch: int
    seq_len: int
    world_size: int
    topology: str
    pins: dict[str, Any]


def auto_request(cfg: DictConfig, *, model: str, world_size: int) -> AutoRequest:
    """The request ``cfg`` (a ``parallel=auto`` config) makes of the planner."""
    auto = AutoConfig(**OmegaConf.to_container(cfg.parallel, resolve=True))
    train = cfg.train
    data_seq = cfg.data.get("seq_len") if "data" in cfg else None
    global_batch = auto.global_batch or train.batch_size * train.grad_accum * world_size
    topology = cfg.get("topology")
    name = None if topology is None else topology.get("name_or_path", topology.get("_target_"))
    return AutoRequest(
        model=model,
        global_batch=int(global_batch),
        seq_len=int(data_seq or cfg.model.config.block_size),
        world_size=world_size,
        topology=str(name),
        pins=auto.pins,
    )


def plan_layout(cfg: DictConfig, request: AutoRequest) -> TrainingLayout:
    """The auto-planner's best layout for ``request`` on ``cfg``'s topology.

    Raises:
        ValueError: ``topology=detect`` or a topology without an accelerator section, a model
            the planner cannot describe, a pin it refuses, nothing fitting (the smallest
            layout's need named): one line each.
    """
    topology_cfg = cfg.get("topology")
    hint = (
        "parallel=auto plans on a topology file with an accelerator section: a GPU preset, or "
        "on a CPU host the file `overlapkit calibrate --host --ranks N --output host.yaml` "
        "writes (topology=preset topology.name_or_path=host.yaml)"
    )
    if topology_cfg is None or topology_cfg.get("_target_") == DETECT:
        raise ValueError(f"{hint}; topology=detect describes the ranks only once they run")
    topology = instantiate(topology_cfg)()
    if topology.accelerator is None:
        raise ValueError(f"{hint}; topology {topology.name!r} has none")
    model_config = instantiate(cfg.model.config)
    if getattr(model_config, "n_head", None) is None:
        raise ValueError(
            f"parallel=auto plans transformers (model=gpt_tiny, moe_tiny); "
            f"{type(model_config).__name__} has no attention heads"
        )
    spec = train_model_spec(model_config, name=request.model)
    try:
        answer = auto_plan(
            topology,
            spec,
            global_batch=request.global_batch,
            seq_len=request.seq_len,
            fixed=AutoConfig(pins=request.pins).fixed(),
            framework="overlapkit-train",
            precision="fp32",
        )
    except (PlanSearchError, TypeError) as err:
        raise ValueError(f"parallel=auto on {topology.name}: {err}") from None
    return answer.best.layout


def winner_overrides(layout: TrainingLayout) -> list[str]:
    """The overrides that run ``layout`` (``run it:``'s, without model, topology, launcher)."""
    group = parallel_group(layout)
    return [f"parallel={group}", *plan_overrides(layout, group), *batch_overrides(layout)]


def kept_overrides(task: Sequence[str]) -> list[str]:
    """The command line's overrides but those the winner's replace (``REPLACED``)."""
    out = []
    for override in task:
        key = override.lstrip("+~").partition("=")[0]
        if not any(
            key == r or key.startswith(f"{r}.") or key.startswith(f"{r}_") for r in REPLACED
        ):
            out.append(override)
    return out


def resolve_auto(
    cfg: DictConfig,
    *,
    run_dir: Path,
    model: str,
    world_size: int,
    task_overrides: Sequence[str],
    compose: Callable[[list[str]], DictConfig],
) -> DictConfig:
    """The config of the layout ``parallel=auto`` runs: recorded in ``run_dir``, or planned and
    recorded there (see module doc).

    Args:
        cfg (DictConfig): the composed ``parallel=auto`` config.
        run_dir (Path): the run directory (node 0's).
        model (str): the ``model`` group's choice (the planner's name for it).
        world_size (int): ``launcher.nnodes x launcher.nproc_per_node``.
        task_overrides (Sequence[str]): the command line's overrides.
        compose (Callable): composes the config from overrides (``hydra.compose``'s).

    Raises:
        ValueError: a recorded layout planned for another request; the planner's refusals
            (``plan_layout``).
    """
    request = auto_request(cfg, model=model, world_size=world_size)
    record = run_dir / RECORD_NAME
    if record.exists():
        kept = json.loads(record.read_text())
        if kept["request"] != asdict(request):
            raise ValueError(
                f"{record} holds the layout parallel=auto chose at this run's first start, for "
                f"{kept['request']}; this start asks for {asdict(request)}. A run keeps its "
                "layout across restarts: rerun with the same settings, choose another name=..., "
                f"or delete {record.name} to plan afresh"
            )
        layout = layout_from_dict(kept["layout"])
        logger.info(
            "parallel=auto: reusing %s from %s (not planned again)", layout.describe(), record
        )
    else:
        layout = plan_layout(cfg, request)
        run_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(
            json.dumps(
                {
                    "request": asdict(request),
                    "layout": layout_dict(layout),
                    "overrides": winner_overrides(layout),
                },
                indent=2,
            )
            + "\n"
        )
        logger.info(
            "parallel=auto: ok.plan(..., auto=True, framework='overlapkit-train') chose %s for "
            "%d sequences of %d tokens on %s; recorded in %s",
            layout.describe(),
            request.global_batch,
            request.seq_len,
            request.topology,
            record,
        )
    return compose(kept_overrides(task_overrides) + winner_overrides(layout))
