"""The ``overlapkit-train`` config tree: every option composes and builds; bad values are named.

No processes are started: configs are composed with Hydra's compose API (the same tree the
application loads) and their cheap objects are instantiated.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import InterpolationKeyError

import overlapkit as ok
from overlapkit.conf.run_name import path_safe_name
from overlapkit.profiling import Profile
from overlapkit.topology import detect_topology, load_topology
from overlapkit.train.launch.cli import (
    check_fresh_start,
    check_job,
    check_missing,
    node_rank_from_argv,
)
from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.models import MoEGPT
from overlapkit.train.parallel.mesh import PlanConfig, split_parallel
from overlapkit.train.planning.parallel_auto import AutoConfig
from overlapkit.train.run.data import SyntheticRegression, SyntheticTokens, TextCorpus
from overlapkit.train.run.loop import TrainConfig
from tests.test_slurm_env import ONE_NODE_TWO_TASKS

CONF = Path(ok.__file__).parent / "conf"
REPO = Path(__file__).resolve().parent.parent
# Option files of each group, found on disk so that a new file is tested without editing this.
OPTIONS = sorted(
    (path.parent.name, path.stem) for path in CONF.glob("*/*.yaml") if path.parent.name != "local"
)


def _compose(*overrides: str) -> DictConfig:
    """The config as ``overlapkit-train OVERRIDES`` sees it, with ``${hydra:...}`` resolvable."""
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]  # as Hydra hands the config to the task
    return cfg


def _raises(error: type[Exception], message: str):
    """Raised directly, or by a ``_target_`` (Hydra wraps those, keeping the cause)."""
    return pytest.raises((error, InstantiationException), match=message)


def test_top_level_conf_is_the_installed_tree():
    assert (REPO / "conf").resolve() == CONF.resolve()
    assert {group for group, _ in OPTIONS} == {
        "data",
        "launcher",
        "live",
        "model",
        "optim",
        "parallel",
        "profiler",
        "recipe",
        "topology",
        "train",
    }


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_builds(group, option, monkeypatch):
    overrides = [f"{group}={option}"]
    if group == "launcher" and option == "multinode":
        overrides += ["launcher.node_rank=1", "launcher.rdzv_endpoint=127.0.0.1:29500"]
    if group == "launcher" and option == "slurm":  # inside an srun task
        for name, value in ONE_NODE_TWO_TASKS.items():
            monkeypatch.setenv(name, value)
    if group == "data" and option == "regression":
        overrides += ["model=mlp"]  # the data for a model of float features
    if group == "parallel" and option == "bucketer_overlap":
        overrides += ["train.clip_grad_norm=null"]  # refused with per-bucket updates
    if group == "parallel" and option == "pp_dp":
        overrides += ["train.grad_accum=2"]  # 1F1B keeps pp micro-batches in flight
    cfg = _compose(*overrides)
    launcher = instantiate(cfg.launcher)
    if group == "parallel" and option == "auto":  # planned first (tests/test_train_auto.py)
        assert AutoConfig(**OmegaConf.to_container(cfg.parallel)).auto
        with pytest.raises(ValueError, match="parallel=auto: the planner chooses the layout"):
            check_job(cfg, launcher)
        return
    assert isinstance(launcher, LauncherConfig)
    assert isinstance(instantiate(cfg.train), TrainConfig)
    check_job(cfg, launcher)  # builds model config, data, optimizer, scheduler, profiler
    model = instantiate(cfg.model)
    assert isinstance(model, torch.nn.Module) and len(model.blocks) >= 1


def test_parallel_options_call_the_public_api_with_planned_sizes():
    fsdp = {"prefetch": 1, "mixed_precision": None, "reshard_after_forward": True}
    expected = {
        "ddp": (ok.ddp, {"bucket_mb": None, "compress": None}, {}),
        "ddp_bf16": (ok.ddp, {"bucket_mb": None, "compress": "bf16"}, {}),
        "bucketer": (ok.GradBucketer, {"bucket_mb": 25}, {}),
        "bucketer_overlap": (ok.GradBucketer, {"bucket_mb": None, "optimizer": "optim"}, {}),
        "fsdp": (ok.fsdp, fsdp, {}),
        "fsdp_prefetch2": (ok.fsdp, fsdp | {"prefetch": 2}, {}),
        "fsdp_overlap": (ok.fsdp, fsdp | {"optimizer_step": "by_block"}, {}),
        "hsdp": (ok.fsdp, fsdp, {"dp_shard": 2}),
        "zero1": (ok.fsdp, fsdp | {"reshard_after_forward": None, "zero": 1}, {}),
        "zero2": (ok.fsdp, fsdp | {"reshard_after_forward": None, "zero": 2}, {}),
        "cp_dp": (ok.ddp, {"bucket_mb": None, "compress": None}, {"cp": 2}),
        "tp_dp": (ok.GradBucketer, {"bucket_mb": 25}, {"tp": 2}),
        "ep_dp": (ok.GradBucketer, {"bucket_mb": 25}, {"ep": 2}),
        "pp_dp": (ok.ddp, {"bucket_mb": None, "compress": None}, {"pp": 2}),
    }
    assert {option for group, option in OPTIONS if group == "parallel"} == {*expected, "auto"}
    for option, (target, keywords, sizes) in expected.items():
        plan, factory_cfg = split_parallel(_compose(f"parallel={option}").parallel)
        factory = instantiate(factory_cfg)
        assert (factory.func, factory.keywords) == (target, keywords), option
        assert plan == PlanConfig.of(**sizes), option


def test_choosing_ep_dp_also_chooses_moe_tiny_unless_model_is_given():
    assert isinstance(instantiate(_compose("parallel=ep_dp").model), MoEGPT)
    cfg = _compose("parallel=ep_dp", "model=gpt_tiny")
    with pytest.raises(ValueError, match=r"parallel.plan.ep=2 needs a mixture-of-experts model"):
        check_job(cfg, instantiate(cfg.launcher))


def test_topology_options_build_the_topology_api():
    assert instantiate(_compose("topology=detect").topology).func is detect_topology
    preset = instantiate(_compose("topology=preset").topology)
    assert preset.func is load_topology
    assert preset().world_size == 2


def test_defaults_are_gpt_tiny_ddp_synthetic_unprofiled():
    cfg = _compose()
    assert cfg.name == "gpt_tiny-ddp"
    assert cfg.get("profiler") is None
    assert isinstance(instantiate(cfg.data), SyntheticTokens)
    assert cfg.data.seq_len == cfg.model.config.block_size


def _run_dir(*overrides: str) -> str:
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg.hydra.run.dir


@pytest.mark.parametrize(
    "name, directory",
    [
        ("team/exp1", "team%2Fexp1"),  # before: runs/team/exp1, inside run "team"'s directory
        ("/etc", "%2Fetc"),
        ("..", "%2E."),  # before: runs/.., outside runs/
        (".hidden", "%2Ehidden"),
        ("a%2Fb", "a%252Fb"),  # not the directory of "a/b"
        ("back\\slash\nnew line\x7f", "back%5Cslash%0Anew line%7F"),
        ("two=(a,b)", "two=(a,b)"),
        ("ünïcode", "ünïcode"),
    ],
)
def test_a_run_name_is_one_directory_under_runs(name, directory):
    assert path_safe_name(name) == directory
    if "\n" not in name:  # what Hydra's override grammar can spell
        assert _run_dir(f"name='{name}'") == f"runs/{directory}"


def test_the_default_run_directory_is_model_and_parallel():
    assert _run_dir() == "runs/gpt_tiny-ddp"


def test_a_run_name_that_no_directory_can_hold_is_refused_naming_it():
    with pytest.raises(ValueError, match="name must not be empty"):
        _run_dir("name=''")
    with pytest.raises(ValueError, match=r"name='x+'\.\.\. is 300 bytes as a directory name"):
        _run_dir(f"name={'x' * 300}")


def test_choosing_mlp_also_chooses_regression_data_unless_data_is_given():
    assert isinstance(instantiate(_compose("model=mlp").data), SyntheticRegression)
    cfg = _compose("model=mlp", "data=synthetic")
    with pytest.raises(InterpolationKeyError, match="'model.config.block_size' not found"):
        check_job(cfg, instantiate(cfg.launcher))


def test_text_recipe_reads_the_shipped_corpus():
    data = instantiate(_compose("recipe=text").data)
    assert isinstance(data, TextCorpus)
    assert data.path.name == "corpus.txt" and 20_000 < len(data.data) < 500_000


def test_demo_recipe_profiles_gpt_tiny_with_ok_ddp():
    cfg = _compose("recipe=demo")
    assert cfg.name == "demo"
    assert instantiate(cfg.parallel).func is ok.ddp
    assert isinstance(instantiate(cfg.profiler)(logdir="unused"), Profile)
    # `profiler=on` typed on the command line is the option named "on", not a boolean.
    assert _compose("profiler=on").profiler.wait == cfg.profiler.wait


@pytest.mark.parametrize(
    "option", [o for g, o in OPTIONS if g == "parallel" and o not in ("ep_dp", "auto")]
)
def test_demo_recipe_builds_with_every_parallel_option(option):
    # The README suggests `overlapkit-train recipe=demo parallel=fsdp`: the recipe must not pin a
    # keyword that only one wrapper takes (it once set parallel.bucket_mb, which ok.fsdp refuses).
    # (ep_dp needs experts; the demo's gpt_tiny is refused by name, tested with the bad values;
    # parallel=auto becomes one of the others before the checks.)
    overrides = ["recipe=demo", f"parallel={option}"]
    if option == "bucketer_overlap":
        overrides += ["train.clip_grad_norm=null"]
    if option == "pp_dp":
        overrides += ["train.grad_accum=2"]
    cfg = _compose(*overrides)
    check_job(cfg, instantiate(cfg.launcher))
    _, factory_cfg = split_parallel(cfg.parallel)
    factory = instantiate(factory_cfg)
    wrapper_keywords = set(factory.keywords) - {"optimizer_step"}  # the loop's, not the wrapper's
    assert wrapper_keywords <= set(inspect.signature(factory.func).parameters), option


def test_override_typo_fails_with_hydras_message():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("parallel.bukcet_mb=5")
    assert "Could not override 'parallel.bukcet_mb'" in str(info.value)
    with pytest.raises(ConfigCompositionException) as info:
        _compose("parallel=dpp")
    assert "Could not find 'parallel/dpp'" in str(info.value)
    assert "Available options in 'parallel'" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["train.steps=0"], ValueError, r"train.steps must be >= 1, got 0"),
        (
            ["train.stop_after=20", "train.steps=10"],
            ValueError,
            r"train.stop_after \(20\) must be <= train.steps \(10\)",
        ),
        (["train.device=tpu"], ValueError, r"train.device must be one of"),
        (
            ["data.seq_len=100"],
            ValueError,
            r"data.seq_len \(100\) exceeds model.config.block_size \(64\)",
        ),
        (
            ["data=text", "data.path=/nonexistent/corpus.txt"],
            FileNotFoundError,
            r"data.path: text corpus '/nonexistent/corpus.txt' does not exist",
        ),
        (["optim.optimizer.lr=-1"], ValueError, r"Invalid learning rate: -1"),
        (["optim.scheduler.min_lr_ratio=2"], ValueError, r"min_lr_ratio must be in \[0, 1\]"),
        (["profiler=on", "profiler.active=0"], ValueError, r"active must be >= 1 steps, got 0"),
        (["live.every=1"], ValueError, r"live.every must be >= 2, got 1"),
        (["live.capacity=5"], ValueError, r"live.capacity \(5\) must be >= live.every \(10\)"),
        (
            ["topology=preset", "topology.name_or_path=dgx-h100"],
            ValueError,
            r"describes 8 ranks, but launcher.nnodes \* launcher.nproc_per_node = 2",
        ),
        (
            ["topology=preset", "topology.name_or_path=dgx-h10"],
            ValueError,
            r"unknown topology preset 'dgx-h10'",
        ),
        (
            ["parallel=tp_dp", "parallel.plan.tp=3"],
            ValueError,
            r"parallel.plan.tp x parallel.plan.ep = 3 x 1 = 3 does not divide the world size 2",
        ),
        (
            ["parallel=tp_dp", "parallel.plan.tp=2", "model.config.n_head=1"],
            ValueError,
            r"parallel.plan.tp \(2\) must divide model.config.n_head \(1\)",
        ),
        (
            ["parallel=ep_dp", "model.config.n_expert=3"],
            ValueError,
            r"parallel.plan.ep \(2\) must divide model.config.n_expert \(3\)",
        ),
        (
            ["parallel=hsdp", "parallel.plan.dp_shard=4"],
            ValueError,
            r"parallel.plan.dp_shard \(4\) must divide the data-parallel size 2",
        ),
        (
            ["parallel=tp_dp", "parallel._target_=overlapkit.ddp"],
            ValueError,
            r"parallel.plan.tp=2 needs parallel._target_ overlapkit.GradBucketer",
        ),
        (
            ["parallel=hsdp", "parallel.plan.dp_shard=1"],
            ValueError,
            r"parallel.plan.dp_shard \(1\) must divide .* above 1 .* use parallel=ddp",
        ),
        (
            ["parallel=pp_dp", "parallel.plan.schedule=LoopedBFS", "train.grad_accum=2"],
            ValueError,
            r"schedule=LoopedBFS runs several stages per rank, got parallel.plan.virtual_stages=1",
        ),
        (  # the capability table's rows (overlapkit.layout.overlapkit_train), by config key
            [
                "parallel=pp_dp",
                "parallel.plan.schedule=Interleaved1F1B",
                "parallel.plan.virtual_stages=2",
                "train.grad_accum=3",
            ],
            ValueError,
            r"train.grad_accum=3 micro-batches per step are not a multiple of parallel.plan.pp=2",
        ),
        (
            ["parallel=zero2", "+parallel.plan.pp=2", "train.grad_accum=2"],
            ValueError,
            r"parallel.zero=2 \(ZeRO-2\) with parallel.plan.pp=2",
        ),
        (["parallel=tp_dp", "~topology"], ValueError, r"parallel.plan needs a topology"),
        (
            ["parallel=cp_dp", "parallel.plan.cp=2", "data.seq_len=30"],
            ValueError,
            r"parallel.plan.cp=2: the load-balanced split .* must divide data.seq_len \(30\)",
        ),
        (
            ["parallel=cp_dp", "model=mlp"],
            ValueError,
            r"parallel.plan.cp=2 splits the sequences of a transformer",
        ),
        (["train.recompute=some"], ValueError, r"train.recompute must be one of \['none'"),
        (
            ["train.recompute=full", "train.recompute_layers=5"],
            ValueError,
            r"train.recompute_layers \(5\) exceeds the 4 blocks of a stage",
        ),
        (
            ["model=mlp", "train.recompute=selective"],
            ValueError,
            r"train.recompute=selective recomputes the attention core",
        ),
        (
            ["parallel=zero1", "parallel.reshard_after_forward=true"],
            ValueError,
            r"zero=1 keeps the parameters gathered",
        ),
        (
            # 2 nodes of 2 ranks: this axis order puts each tp pair on both nodes.
            [
                "parallel=tp_dp",
                "+parallel.plan.order=[pp,tp,dp,ep,cp]",
                "launcher.nproc_per_node=4",
                "topology=preset",
                "topology.name_or_path=cpu-gloox2",
            ],
            ValueError,
            r"cannot place tp=2 dp=2 on 'cpu-gloox2' without splitting a scale-up domain",
        ),
    ],
)
def test_bad_values_are_reported_by_their_key_before_launch(overrides, error, message):
    cfg = _compose(*overrides)
    with _raises(error, message):
        check_job(cfg, instantiate(cfg.launcher))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher.nnodes=2"], r"launcher.nnodes=2 needs launcher.rdzv_endpoint=HOST:PORT"),
        (
            ["launcher.nnodes=2", "launcher.node_rank=2", "launcher.rdzv_endpoint=h:1"],
            r"launcher.node_rank \(2\) must be < launcher.nnodes \(2\)",
        ),
        (["launcher.rdzv_endpoint=localhost"], r"launcher.rdzv_endpoint must be HOST:PORT"),
        (["launcher.nproc_per_node=0"], r"launcher.nproc_per_node must be >= 1, got 0"),
        (
            ["launcher.collective_timeout_s=inf"],
            r"launcher.collective_timeout_s must be a finite number > 0 s, got inf",
        ),
    ],
)
def test_launcher_values_are_checked(overrides, message):
    with _raises(ValueError, message):
        instantiate(_compose(*overrides).launcher)


def test_multinode_launcher_requires_node_rank_and_endpoint():
    with pytest.raises(ValueError, match=r"launcher.node_rank, launcher.rdzv_endpoint \(\?\?\?"):
        check_missing(_compose("launcher=multinode"))
    check_missing(
        _compose(
            "launcher=multinode", "launcher.node_rank=0", "launcher.rdzv_endpoint=127.0.0.1:29500"
        )
    )


def test_launch_config_standalone_and_multinode(tmp_path):
    local = LauncherConfig(nproc_per_node=3).launch_config(tmp_path)
    assert (local.rdzv_backend, local.rdzv_endpoint, local.nproc_per_node) == (
        "c10d",
        "localhost:0",
        3,
    )
    assert (local.min_nodes, local.max_nodes) == (1, 1)
    node = LauncherConfig(
        nproc_per_node=1, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"
    ).launch_config(tmp_path)
    assert (node.rdzv_backend, node.rdzv_endpoint, node.run_id) == (
        "static",
        "10.0.0.1:29500",
        "overlapkit",
    )
    assert node.rdzv_configs["rank"] == 1 and (node.min_nodes, node.max_nodes) == (2, 2)


def test_node_rank_is_read_from_the_command_line():
    assert node_rank_from_argv([]) == 0
    assert node_rank_from_argv(["launcher=multinode", "launcher.node_rank=1"]) == 1
    assert node_rank_from_argv(["++launcher.node_rank=3", "train.steps=5"]) == 3
    assert node_rank_from_argv(["launcher.node_rank=x"]) == 0  # left to the config check


def test_fresh_start_refuses_an_earlier_runs_checkpoints(tmp_path):
    fresh = _compose("train.resume=false")
    check_fresh_start(fresh, tmp_path)  # nothing there yet
    step = tmp_path / "checkpoints" / "step_00000050"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds checkpoints \(newest: step 50\)"):
        check_fresh_start(fresh, tmp_path)
    check_fresh_start(_compose(), tmp_path)  # resuming from them is the default
    check_fresh_start(_compose("recipe=demo"), tmp_path)  # the demo saves no checkpoints


def test_recipes_readme_lists_exactly_the_config_options():
    text = (REPO / "recipes" / "README.md").read_text()
    for group in {g for g, _ in OPTIONS}:
        row = re.search(rf"^\| `{group}` \| (.*?) \|", text, re.MULTILINE)
        assert row, f"recipes/README.md has no row for the {group!r} group"
        listed = set(re.findall(r"`([^`]+)`", row[1]))
        assert listed == {o for g, o in OPTIONS if g == group}, group
