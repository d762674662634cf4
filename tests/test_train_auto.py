"""The search proposes exactly what overlapkit-train runs, and ``parallel=auto`` runs the winner.

Search to train: the combinations come from the search itself (``autoplan.search.searched_layouts``
under ``framework=overlapkit-train``, on a 4-rank two-node CPU preset and an 8-GPU one, gpt_tiny
and moe_tiny): one layout per combination of parallel dimensions above 1, sharding and
interleaving, the smallest, with the recomputation modes (none, selective, full, full:1) dealt
round them. Each gets its ``run it:`` line (``train_overrides``), composed by Hydra from the real
config groups, put through overlapkit-train's pre-launch checks (``check_job``) and read back
into the same layout (``train.parallel.run_layout``); so is a scaled-down copy of each on 4 ranks.

Train to search: every layout overlapkit-train's checks accept, over a grid of sizes, the config
groups of every sharding, recomputation modes, pipeline schedules and micro-batch counts on both
presets, is one the search proposes with its choices pinned; the schedules it accepts and the
search does not propose are the ones the capability table marks as not planned.

One launch of 4 gloo ranks trains a covering subset of the copies (every dimension, sharding,
recomputation mode and interleaving at least once) and the job ``overlapkit-train parallel=auto``
hands to its launcher. Each first loss equals one process's loss of the same initial model on the
batches rank 0 read, and each measured step fits in the wall time the test measured around it.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import overlapkit as ok
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.handoff.run_config import train_overrides
from overlapkit.autoplan.layout_space import divisors
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.pipeline_schedule import priced, schedule_of
from overlapkit.autoplan.search import searched_layouts
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.layout import RECOMPUTE, SHARDING, PartialLayout, TrainingLayout
from overlapkit.layout.overlapkit_train import SCHEDULES, WRAPPERS, schedule_named
from overlapkit.planner import plan as place
from overlapkit.topology import load_topology
from overlapkit.train.launch import cli
from overlapkit.train.launch.cli import check_job
from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.models import GPTConfig, MoEConfig
from overlapkit.train.parallel.mesh import PlanConfig, data_shard, split_parallel
from overlapkit.train.parallel.run_layout import check_parallel, run_layout
from overlapkit.train.planning.parallel_auto import RECORD_NAME
from overlapkit.train.run.data import BatchStream
from overlapkit.train.run.loop import TrainConfig
from tests.multiproc import run_on_ranks

SHAPE = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)  # conf/model
MODELS = {
    "gpt_tiny": GPTConfig(**SHAPE),
    "moe_tiny": MoEConfig(**SHAPE, n_expert=4, top_k=2, expert_hidden=256),
}
RECOMPUTE_MODES = ("none", "selective", "full", "full:1")
FULL_1 = {"recompute": "full", "recompute_layers": 1}
PINS = ({}, {"cp": 2}, FULL_1, {"cp": 2} | FULL_1)
"""The free search keeps at least 2,048 tokens per cp rank (64 here): cp is pinned to be seen."""
MULTINODE = ["launcher.node_rank=0", "launcher.rdzv_endpoint=127.0.0.1:29500"]
GPU = ok.load_topology("dgx-a100").accelerator
PRESETS = ("cpu-gloox2", "dgx-a100")
"""4 ranks on 2 nodes, 8 on one."""
OVERLAPKIT_TRAIN_SEARCH = SearchSettings(framework=OVERLAPKIT_TRAIN)


@functools.cache
def searchable(preset: str):
    """``preset`` with an accelerator section (the CPU preset borrows the A100's)."""
    topology = load_topology(preset)
    return topology if topology.accelerator else topology.with_accelerator(GPU)


def host_yaml(path: Path, *, nodes: int, per_node: int, memory: str = "8GB", **host) -> Path:
    """A CPU host's topology file as ``overlapkit calibrate --host`` writes it (fixed figures)."""
    terms = {
        "collective_overhead": "1ms",
        "tp_layer_dispatch": "3ms",
        "optimizer_tensor": "40us",
        "optimizer_dtensor": "300us",
        "optimizer_param": "8ns",
        "overlap_efficiency": 0.5,
    } | host
    doc = {
        "name": path.stem,
        "library": "gloo",
        "nodes": nodes,
        "devices_per_node": per_node,
        "device_kind": "cpu",
        "scale_up": {"kind": "none", "links": 0, "bandwidth": "1GB/s", "latency": "500us"},
        "scale_out": {
            "kind": "fat-tree",
            "transport": "ethernet",
            "nics_per_node": 1,
            "nic_bandwidth": "0.1GB/s",
            "latency": "1ms",
        },
        "accelerator": {
            "name": "measured-host",
            "memory": memory,
            "peak_bf16_tflops": 0.01,
            "host": terms,
        },
    }
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


# -- search to train ---------------------------------------------------------------------------


def _combination(layout: TrainingLayout, model: str) -> tuple:
    dims = tuple(d for d in ("tp", "pp", "cp", "ep", "dp") if layout.dims[d] > 1)
    return model if layout.ep > 1 else "gpt_tiny", dims, layout.sharding, layout.virtual_stages > 1


def _recompute(layout: TrainingLayout) -> str:
    return layout.recompute if layout.recompute_layers is None else "full:1"


def _model_size(layout: TrainingLayout) -> int:
    return layout.tp * layout.pp * layout.cp * layout.ep


@functools.cache
def combinations() -> dict[tuple, tuple[str, TrainingLayout]]:
    """(model, dims above 1, sharding, interleaved) -> (preset, the smallest layout), with the
    recompute modes dealt round the combinations in order."""
    found: dict[tuple, dict[str, tuple[str, TrainingLayout]]] = {}
    for preset, (model, config), pins in itertools.product(PRESETS, MODELS.items(), PINS):
        spec = train_model_spec(config, name=model)
        for layout in searched_layouts(
            searchable(preset),
            spec,
            global_batch=16,
            seq_len=64,
            fixed=pins,
            settings=OVERLAPKIT_TRAIN_SEARCH,
        ):
            size = (layout.world_size, _model_size(layout))
            kinds = found.setdefault(_combination(layout, model), {})
            best = kinds.get(_recompute(layout))
            if best is None or size < (best[1].world_size, _model_size(best[1])):
                kinds[_recompute(layout)] = (preset, layout)
    keys = sorted(found, key=str)
    return {
        key: found[key][RECOMPUTE_MODES[i % len(RECOMPUTE_MODES)]] for i, key in enumerate(keys)
    }


@functools.cache
def composed() -> dict[tuple, DictConfig]:
    """Each combination's ``run it:`` line composed from the config groups."""
    out = {}
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        for key, (preset, layout) in combinations().items():
            topology = load_topology(preset)
            overrides = train_overrides(
                layout,
                topology=preset,
                nodes=topology.num_nodes,
                ranks_per_node=len(topology.nodes()[0]),
                model=key[0],
                layers=SHAPE["n_layer"],
            )
            extra = MULTINODE if topology.num_nodes > 1 else []
            out[key] = compose(config_name="config", overrides=[*overrides, *extra])
    return out


def _layout_of(cfg: DictConfig, world_size: int) -> TrainingLayout | None:
    plan, factory = split_parallel(cfg.parallel)
    return run_layout(plan, factory, cfg.train, world_size=world_size)


def test_the_search_proposes_every_dimension_sharding_and_recompute_mode_overlapkit_train_runs():
    keys = set(combinations())
    for expected in (
        ("gpt_tiny", ("pp", "dp"), "hsdp", True),  # 8 ranks: pp 2 x (2 replicas x 2 shards)
        ("gpt_tiny", ("tp", "pp", "dp"), "ddp", True),
        ("gpt_tiny", ("tp", "cp", "dp"), "ddp", False),
        ("gpt_tiny", ("cp", "dp"), "zero2", False),
        ("gpt_tiny", ("pp", "dp"), "zero1", False),
        ("moe_tiny", ("ep", "dp"), "ddp", False),
    ):
        assert expected in keys
    assert {sharding for _, _, sharding, _ in keys} == set(SHARDING)
    dealt = [_recompute(layout) for _, layout in combinations().values()]
    assert all(dealt.count(mode) >= 5 for mode in RECOMPUTE_MODES), dealt


def test_every_combinations_run_line_passes_the_checks_before_launch_and_runs_that_layout():
    for key, cfg in composed().items():
        preset, layout = combinations()[key]
        launcher = instantiate(cfg.launcher)
        check_job(cfg, launcher)  # what overlapkit-train checks before starting workers
        world_size = launcher.nnodes * launcher.nproc_per_node
        assert world_size == load_topology(preset).world_size, key
        assert _layout_of(cfg, world_size) == layout, key


# -- train to search ---------------------------------------------------------------------------

GROUPS = ("ddp", "bucketer", "zero1", "zero2", "fsdp", "hsdp")
"""The ``parallel`` groups that spell a sharding (each wrapper of the capability table's)."""
RECOMPUTES = (("none", None), ("selective", None), ("full", None), ("full", 1))


@functools.cache
def wrapper_configs() -> dict[str, dict]:
    """Each group's wrapper factory config (``parallel`` without ``plan``), as Hydra composes it."""
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        return {
            group: split_parallel(
                compose(config_name="config", overrides=[f"parallel={group}"]).parallel
            )[1]
            for group in GROUPS
        }


def _sizes(world: int) -> list[dict[str, int]]:
    """Every ``(tp, pp, cp, ep)`` whose product divides ``world``."""
    return [
        dict(zip(("tp", "pp", "cp", "ep"), sizes, strict=True))
        for sizes in itertools.product(divisors(world), repeat=4)
        if world % math.prod(sizes) == 0
    ]


def _runs(world: int):
    """``(sizes, schedule, virtual_stages, micro-batches, recompute)`` of the grid on ``world``
    ranks, in three parts whose rules do not meet: every size tuple with every recomputation
    (1F1B, one stage per rank, pp micro-batches); every pipeline of pp and tp (cp or ep with pp
    are refused by schedule-blind rows) with every schedule, one and two stages per rank and 1
    to 4 micro-batches; and interleaved pipelines with every recomputation (full:1 against the
    blocks of a model chunk)."""
    for sizes, recompute in itertools.product(_sizes(world), RECOMPUTES):
        yield sizes, "1F1B", 1, sizes["pp"], recompute
    pipelines = [s for s in _sizes(world) if s["pp"] > 1 and s["cp"] == s["ep"] == 1]
    schedules = [schedule.name for schedule in SCHEDULES]
    for sizes, schedule, stages, micro in itertools.product(
        pipelines, schedules, (1, 2), (1, 2, 3, 4)
    ):
        yield sizes, schedule, stages, micro, RECOMPUTES[0]
    for sizes, micro, recompute in itertools.product(pipelines, (2, 4), RECOMPUTES):
        yield sizes, "Interleaved1F1B", 2, micro, recompute


def _train_configs():
    """``(preset, model, PlanConfig, group, TrainConfig)`` over the grid (``_runs``, every
    group of a sharding, every ``dp_shard`` of hsdp)."""
    for preset in PRESETS:
        world = topology_of(preset).world_size
        for sizes, schedule, stages, micro, (mode, layers) in _runs(world):
            model = "moe_tiny" if sizes["ep"] > 1 else "gpt_tiny"
            dp = world // math.prod(sizes.values())
            train = TrainConfig(
                batch_size=1, grad_accum=micro, recompute=mode, recompute_layers=layers
            )
            for group in GROUPS:
                for dp_shard in divisors(dp) if group == "hsdp" else [None]:
                    shard = {} if dp_shard is None else {"dp_shard": dp_shard}
                    plan = PlanConfig.of(**sizes, **shard, schedule=schedule, virtual_stages=stages)
                    yield preset, model, plan, group, train


@functools.cache
def topology_of(preset: str):
    return load_topology(preset)


@functools.cache
def _placed(preset: str, plan: PlanConfig) -> bool:
    """Whether the planner places ``plan``'s sizes on ``preset`` (its own refusals)."""
    try:
        place(topology_of(preset), **plan.sizes.placement_sizes(), order=plan.order)
    except ValueError:
        return False
    return True


def _accepted(preset: str, model: str, plan: PlanConfig, factory: dict, train: TrainConfig) -> bool:
    """Whether overlapkit-train's checks before launch let this run start (``check_job``'s
    checks of the ``parallel`` group, and the planner placing its sizes on the topology)."""
    try:
        check_parallel(
            plan,
            factory,
            train,
            world_size=topology_of(preset).world_size,
            model_config=MODELS[model],
            seq_len=SHAPE["block_size"],
        )
    except ValueError:
        return False
    return _placed(preset, plan)


def test_every_layout_overlapkit_train_accepts_is_one_the_search_proposes():
    accepted, unplanned, unpriced = [], set(), set()
    for preset, model, plan, group, train in _train_configs():
        factory = wrapper_configs()[group]
        if not _accepted(preset, model, plan, factory, train):
            continue
        layout = run_layout(plan, factory, train, world_size=topology_of(preset).world_size)
        if not schedule_named(plan.schedule).planned:
            unplanned.add(plan.schedule)
            continue
        if not priced(schedule_of(layout), layout):
            unpriced.add(plan.schedule)
            continue
        proposed = searched_layouts(
            searchable(preset),
            train_model_spec(MODELS[model], name=model),
            global_batch=layout.global_batch,
            seq_len=SHAPE["block_size"],
            fixed=PartialLayout.of(layout),
            settings=OVERLAPKIT_TRAIN_SEARCH,
        )
        assert layout in proposed, (preset, model, plan, group, train)
        accepted.append(layout)
    # The schedules train runs that the search does not propose are the table's unplanned ones,
    # and the zero-bubble ones below the micro-batches whose shape the planner prices
    # (InterleavedZeroBubble under pp, ZBVZeroBubble under 2 pp - 1).
    assert unplanned == {s.name for s in SCHEDULES if not s.planned}
    assert unpriced == {"InterleavedZeroBubble", "ZBVZeroBubble"}
    # Not vacuous: every dimension, sharding, recomputation and interleaving was accepted.
    assert {layout.sharding for layout in accepted} == set(SHARDING)
    assert {layout.recompute for layout in accepted} == set(RECOMPUTE)
    for axis in ("tp", "pp", "cp", "ep"):
        assert any(getattr(layout, axis) > 1 for layout in accepted), axis
    assert any(layout.virtual_stages > 1 for layout in accepted)
    assert any(layout.recompute_layers == 1 for layout in accepted)
    assert {w.target for w in WRAPPERS} <= {c["_target_"] for c in wrapper_configs().values()}


# -- a covering subset trained on 4 ranks ------------------------------------------------------

COPY = {
    "model.config.n_embd": 16,
    "model.config.block_size": 16,
    "train.steps": 1,
    "train.batch_size": 2,
    "train.checkpoint_every": 0,
    "train.progress": False,
    "train.device": "cpu",
}


def scaled_copy(cfg: DictConfig, topology_file: Path, name: str) -> dict:
    """``cfg`` on 4 ranks (dp shrinks with the world): a 16-wide model, one step, no
    checkpoint, the micro-batches a pipeline needs; checked as overlapkit-train checks it."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, value in COPY.items():
        OmegaConf.update(copy, key, value)
    plan, _ = split_parallel(copy.parallel)
    copy.train.grad_accum = plan.sizes.pp * plan.sizes.virtual_stages
    copy.topology.name_or_path = str(topology_file)
    copy.name = name
    check_job(copy, LauncherConfig(nproc_per_node=4))
    return OmegaConf.to_container(copy, resolve=False)


def _features(layout: TrainingLayout) -> set[str]:
    """What a trained copy covers: its dimensions above 1, sharding, recompute mode, v > 1."""
    out = {axis for axis, size in layout.dims.items() if size > 1}
    out |= {layout.sharding, _recompute(layout)}
    return out | ({"interleaved"} if layout.virtual_stages > 1 else set())


def covering(jobs: dict[tuple, dict]) -> dict[tuple, dict]:
    """Few of ``jobs`` that cover every feature any of them has (greedy set cover)."""
    features = {key: _features(_layout_of(OmegaConf.create(job), 4)) for key, job in jobs.items()}
    missing = set().union(*features.values())
    chosen = {}
    while missing:
        key = max(features, key=lambda k: len(features[k] & missing))
        chosen[key] = jobs[key]
        missing -= features[key]
    return chosen


@functools.cache
def copies(topology_file: Path) -> dict[tuple, dict]:
    return {
        key: scaled_copy(cfg, topology_file, f"copy{i}")
        for i, (key, cfg) in enumerate(composed().items())
    }


def test_a_scaled_down_copy_of_every_combination_passes_the_checks_on_4_ranks(tmp_path):
    jobs = copies(host_yaml(tmp_path / "two-nodes.yaml", nodes=2, per_node=2))
    assert len(jobs) == len(combinations())
    chosen = covering(jobs)
    every = set().union(*(_features(_layout_of(OmegaConf.create(j), 4)) for j in jobs.values()))
    assert (
        set().union(*(_features(_layout_of(OmegaConf.create(j), 4)) for j in chosen.values()))
        == every
    )
    assert {"tp", "pp", "cp", "ep", "interleaved", *SHARDING, *RECOMPUTE_MODES} <= every
    assert len(chosen) < len(jobs) / 2


def reference_first_loss(job: dict) -> float:
    """The first step's loss on rank 0 as one process computes it: the same initial model (the
    run's seed) on the micro-batches rank 0's data shard reads, averaged as ``train_step`` does."""
    cfg = OmegaConf.create(job)
    train = instantiate(cfg.train)
    torch.manual_seed(train.seed)
    model = instantiate(cfg.model)
    source = instantiate(cfg.data)
    plan, _ = split_parallel(cfg.parallel)
    topology = instantiate(cfg.topology)()
    index, _ = data_shard(place(topology, **plan.sizes.placement_sizes(), order=plan.order), 0)
    stream = BatchStream(source, rank=index, batch_size=train.batch_size)
    with torch.no_grad():
        losses = [
            source.loss(model(inputs), targets)
            for inputs, targets in (stream.next() for _ in range(train.grad_accum))
        ]
    return float(sum(losses) / train.grad_accum)


def _train_each(rank: int, world_size: int, jobs: list[dict], root: str) -> list[dict | None]:
    from overlapkit.train.run.loop import RunPaths, train

    summaries = []
    for index, job in enumerate(jobs):
        run_dir = Path(root) / str(index)
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        summary = train(OmegaConf.create(job), RunPaths(run_dir, "t"), local_rank=rank)
        wall_s = time.perf_counter() - start
        if summary is not None:
            summary = asdict(summary) | {"text": summary.format(), "wall_s": wall_s}
        summaries.append(summary)
    return summaries


def _captured_auto_job(tmp_path: Path, monkeypatch, argv: list[str]) -> tuple[dict, Path]:
    """Run ``overlapkit-train parallel=auto ...`` (the Hydra app, its planning and checks) up to
    the launch, and return the job it hands to the launcher."""
    captured = {}

    def launch(job, run_dir, launcher):
        captured.update(job=job, run_dir=run_dir)

    monkeypatch.setattr(cli, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["overlapkit-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the error itself, not Hydra's exit
    monkeypatch.chdir(tmp_path)
    cli.main()
    return captured["job"], Path(captured["run_dir"])


AUTO = [
    "parallel=auto",
    "topology=preset",
    "launcher.nproc_per_node=4",
    "train.steps=3",
    "train.progress=false",
    "train.device=cpu",
    "model.config.n_embd=32",
    "hydra.run.dir=runs/auto",
]


def test_parallel_auto_plans_records_and_reuses_the_layout_and_refuses_a_changed_request(
    tmp_path, monkeypatch
):
    host = host_yaml(tmp_path / "host.yaml", nodes=1, per_node=4)
    argv = [*AUTO, f"topology.name_or_path={host}"]
    job, run_dir = _captured_auto_job(tmp_path, monkeypatch, argv)
    record = json.loads((run_dir / RECORD_NAME).read_text())
    assert record["request"]["global_batch"] == 8 * 4 and record["request"]["seq_len"] == 64
    # The job is the winner's: what ok.plan(..., auto=True) chooses for the same request.
    spec = train_model_spec(GPTConfig(**(SHAPE | {"n_embd": 32})), name="gpt_tiny")

    def winner():
        return ok.plan(
            load_topology(host),
            model=spec,
            global_batch=32,
            seq_len=64,
            auto=True,
            framework="overlapkit-train",
            precision="fp32",
        ).training

    best = winner()
    assert _layout_of(OmegaConf.create(job), 4) == best
    assert job["name"] == "gpt_tiny-auto" and job["train"]["steps"] == 3
    # Another host file now makes the planner choose otherwise; the rerun keeps the record.
    host_yaml(host, nodes=1, per_node=4, optimizer_tensor="100ms")
    moved = winner()
    assert moved != best
    again, _ = _captured_auto_job(tmp_path, monkeypatch, argv)
    assert _layout_of(OmegaConf.create(again), 4) == best
    # A changed request (another global batch) is refused with both named.
    with pytest.raises(ValueError, match=r"planned_layout.json holds the layout .*global_batch"):
        _captured_auto_job(tmp_path, monkeypatch, [*argv, "train.batch_size=4"])


def test_parallel_auto_refuses_no_accelerator_a_bad_pin_and_a_model_that_fits_nowhere(
    tmp_path, monkeypatch
):
    for overrides, message in (
        (["topology=detect"], "topology=detect describes the ranks only once they run"),
        (["topology.name_or_path=cpu-gloox2"], "topology 'cpu-gloox2' has none"),
        (["+parallel.pins.tp=0"], r"parallel.pins.tp must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            _captured_auto_job(tmp_path, monkeypatch, [*AUTO, *overrides])
    tiny = host_yaml(tmp_path / "tiny.yaml", nodes=1, per_node=4, memory="0.01GB")
    with pytest.raises(ValueError, match=r"fits nowhere .* the smallest layout .* needs"):
        _captured_auto_job(tmp_path, monkeypatch, [*AUTO, f"topology.name_or_path={tiny}"])


@pytest.mark.slow
def test_a_covering_subset_of_the_copies_and_the_auto_winner_train_on_4_ranks_as_one_process(
    tmp_path, monkeypatch
):
    chosen = covering(copies(host_yaml(tmp_path / "two-nodes.yaml", nodes=2, per_node=2)))
    one_node = host_yaml(tmp_path / "host.yaml", nodes=1, per_node=4)
    auto_job, run_dir = _captured_auto_job(
        tmp_path, monkeypatch, [*AUTO, f"topology.name_or_path={one_node}"]
    )
    jobs = [*chosen.values(), auto_job]
    summaries = run_on_ranks(_train_each, 4, jobs, str(tmp_path / "runs"), total_timeout_s=600)[0]
    for key, job, summary in zip([*chosen, "auto"], jobs, summaries, strict=True):
        steps = job["train"]["steps"]
        assert summary["steps_run"] == steps, key
        # The layout computes what one process computes: the same first loss.
        assert summary["loss_first"] == pytest.approx(reference_first_loss(job), rel=2e-5), key
        layout = _layout_of(OmegaConf.create(job), 4)
        assert ("pipeline" in summary["parallel"]) == (layout.pp > 1), key
        assert summary["planned_layout"]["dims"] == layout.dims, key
        assert summary["predicted_step_s"] > 0, key
    auto = summaries[-1]
    record = json.loads((run_dir / RECORD_NAME).read_text())
    assert {k: v for k, v in auto["planned_layout"].items() if k != "text"} == record["layout"]
    # The measured step (the median of the 2 steps after the first, s) fits in the wall time
    # the test measured around the whole run: both of them do.
    assert 0 < 2 * auto["measured_step_s"] < auto["wall_s"]
    last = auto["text"].splitlines()[-1]
    assert "predicted step" in last and "measured" in last and "measured / predicted" in last
