"""``overlapkit plan --auto`` and ``ok.plan(..., auto=True)``: the contract, warnings, errors."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

import overlapkit as ok
from overlapkit.autoplan.auto_cli import run_instructions
from overlapkit.autoplan.auto_report import render_auto
from overlapkit.autoplan.compute import measured_accelerator
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.handoff.run_config import train_overrides
from overlapkit.autoplan.layout_warnings import place_inside
from overlapkit.autoplan.ok_plan import auto_plan
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.cli import main
from overlapkit.planner.placement import plan as place
from overlapkit.planner.traffic import Workload
from overlapkit.topology import load_topology
from overlapkit.train.launch.cli import check_job
from overlapkit.train.launch.elastic import LauncherConfig
from tests.multiproc import run_on_ranks
from tests.test_memory_validation import tiny_spec

CANDIDATE_KEYS = {
    "dims",
    "micro_batch",
    "num_micro_batches",
    "virtual_stages",
    "recompute",
    "recompute_layers",
    "sharding",
    "dp_shard",
    "schedule",
    "step_time_s",
    "tokens_per_s_per_gpu",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "memory_gb_per_gpu",
    "fits",
    "breakdown",
}
AUTO = ["plan", "--auto", "--topology", "dgx-h100x2", "--model", "llama3-8b"]


def _json(capsys, argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_json_has_the_contract_keys_best_first(capsys):
    doc = _json(capsys, [*AUTO, "--global-batch", "64", "--seq-len", "4096", "--candidates", "3"])
    assert {"candidates", "search_s", "searched", "warnings"} <= doc.keys()
    assert isinstance(doc["searched"], int) and doc["searched"] >= len(doc["candidates"]) == 3
    for candidate in doc["candidates"]:
        assert candidate.keys() >= CANDIDATE_KEYS
        assert set(candidate["dims"]) == {"tp", "pp", "dp", "cp", "ep"}
        assert candidate["fits"] and 0 < candidate["mfu"] < 1
        assert candidate["hardware_tflops_per_gpu"] >= candidate["model_tflops_per_gpu"]
    times = [c["step_time_s"] for c in doc["candidates"]]
    assert times == sorted(times)


def test_a_fixed_size_constrains_the_auto_search(capsys):
    doc = _json(capsys, [*AUTO, "--global-batch", "64", "--seq-len", "4096", "--tp", "4"])
    assert {c["dims"]["tp"] for c in doc["candidates"]} == {4}


def test_auto_table_explains_the_winner_and_how_to_run_it(capsys):
    assert main([*AUTO, "--global-batch", "64", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "why #1:" in out and "#1's step:" in out and "placed:" in out
    assert "overlapkit-train" in out or "torchtitan" in out


def test_fixed_layout_that_does_not_fit_is_listed_with_its_breakdown(capsys):
    argv = [*AUTO, "--global-batch", "16", "--seq-len", "8192", "--tp", "1", "--pp", "1"]
    doc = _json(capsys, [*argv, "--cp", "1", "--gpu-memory-gb", "24", "--recompute", "none"])
    best = doc["candidates"][0]
    assert not best["fits"] and best["breakdown"]["memory"]["total_gb"] > 24
    assert any("not to fit" in w for w in doc["warnings"])


def test_fixed_layout_where_nothing_fits_names_the_best_that_fits(capsys):
    model = "gpt:layers=88,hidden=8192,heads=64"  # 71B; tp 16 splits its 64 key/value heads
    argv = ["plan", "--auto", "--topology", "dgx-h100x2", "--model", model, "--tp", "16"]
    assert main([*argv, "--global-batch", "64", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "why #1: nothing listed fits in 80 GB; #1 comes closest" in out
    assert "warning: the best layout the planner finds that fits: " in out
    assert "slower" not in out


def test_the_printed_device_mesh_call_keeps_the_fixed_sizes(capsys):
    argv = [*AUTO, "--global-batch", "64", "--seq-len", "4096", "--tp", "2", "--pp", "2"]
    doc = _json(capsys, argv)
    call = doc["run"]["device_mesh"]
    assert ", tp=2, pp=2, " in call
    # It is runnable as printed: the same layout comes back.
    placement = eval(call.removesuffix(".device_mesh()"), {"ok": ok})
    best = doc["candidates"][0]
    assert placement.training.dims == best["dims"]
    assert placement.training.virtual_stages == best["virtual_stages"]


def test_manual_tp_across_nodes_warns_with_its_cost(capsys):
    assert main(["plan", "--topology", "dgx-h100x2", "--tp", "16"]) == 0
    assert "warning: tp=16 spans 2 scale-up domains" in capsys.readouterr().out
    doc = _json(capsys, ["plan", "--topology", "dgx-h100x2", "--tp", "16"])
    assert doc["warnings"] and "better: tp=8" in doc["warnings"][0]


def test_tp_inside_a_domain_is_compared_at_the_same_sequences_per_step():
    across = place(load_topology("dgx-h100x2"), tp=16, workload=Workload(params=8e9))
    inside = place_inside(across, 8)
    sequences = [
        p.dims["dp"] * p.workload.micro_batch * p.workload.microbatches for p in (across, inside)
    ]
    assert inside.dims["tp"] == 8 and sequences[0] == sequences[1] == 8

    def tp_s(placement):
        return sum(c.total_s for c in placement.collectives() if c.dim == "tp")

    # Half the all-reduces per rank (two replicas share the batch), none of them over the NICs.
    assert tp_s(across) / tp_s(inside) > 2


def test_manual_plan_with_a_model_is_compared_with_the_best(capsys):
    model = "gpt:layers=32,hidden=4096,heads=32"  # GPT-3 6.7B: 32 key/value heads for tp 16
    argv = ["plan", "--topology", "dgx-h100x2", "--tp", "16", "--model", model]
    doc = _json(capsys, [*argv, "--global-batch", "64", "--seq-len", "8192"])
    assert any("slower than the best layout" in w for w in doc["warnings"])


def test_a_manual_plan_within_a_node_gets_no_warning(capsys):
    assert _json(capsys, ["plan", "--topology", "dgx-h100x2", "--tp", "8"])["warnings"] == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "llama3-405b", "--global-batch", "8"], "fits nowhere"),
        (["--model", "llama3-8b", "--global-batch", "7", "--dp", "2"], "--global-batch 7"),
        (["--model", "nope-7b", "--global-batch", "8"], "unknown model 'nope-7b'"),
        (["--model", "llama3-8b"], "needs --global-batch"),
    ],
)
def test_bad_auto_input_is_one_line_naming_it(capsys, extra, message):
    argv = ["plan", "--auto", "--topology", "dgx-h100", "--seq-len", "8192", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_config_json_missing_a_field_is_named(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    argv = ["plan", "--auto", "--topology", "dgx-h100", "--model", str(path)]
    assert main([*argv, "--global-batch", "8", "--seq-len", "128"]) == 2
    assert "config.json: missing 'num_attention_heads'" in capsys.readouterr().err


def test_ok_plan_auto_returns_a_placement_with_the_micro_batching():
    topology = load_topology("dgx-h100x2")
    placement = ok.plan(topology, model="llama3-8b", global_batch=64, seq_len=4096, auto=True)
    training = placement.training
    assert training is not None and placement.dims == {**training.dims, **placement.dims}
    assert placement.workload.micro_batch == training.micro_batch
    assert placement.workload.microbatches == training.num_micro_batches
    assert training.global_batch == 64


def test_ok_plan_without_auto_still_places_the_sizes_given():
    placement = ok.plan(load_topology("dgx-h100x4"), tp=8, pp=2)
    assert placement.dims["dp"] == 2 and placement.training is None
    with pytest.raises(ValueError, match="go with auto=True"):
        ok.plan(load_topology("dgx-h100"), model="llama3-8b")


def _cpu_topology():
    return load_topology("cpu-gloox2").with_accelerator(measured_accelerator(0.05, memory_GB=16))


def test_overrides_for_a_layout_overlapkit_train_runs_compose_and_pass_its_checks():
    # Fixed to one it runs (the free best may be one it lacks, such as tp under FSDP).
    fixed = {"tp": 2, "sharding": "ddp"}
    answer = auto_plan(_cpu_topology(), tiny_spec(), global_batch=8, seq_len=64, fixed=fixed)
    best = answer.best.layout
    assert OVERLAPKIT_TRAIN.refusal(best) is None
    overrides = train_overrides(
        best, topology="cpu-gloox2", nodes=1, ranks_per_node=4, model="gpt_tiny"
    )
    overrides = [o for o in overrides if not o.startswith("launcher")]
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    launcher = LauncherConfig(nnodes=1, nproc_per_node=4, node_rank=0)
    check_job(cfg, launcher)  # what overlapkit-train checks before starting workers
    assert instantiate(cfg.train).grad_accum == best.num_micro_batches


def test_a_tensor_parallel_winner_is_also_priced_as_overlapkit_train_runs_it():
    fixed = {"tp": 2, "sharding": "ddp"}
    answer = auto_plan(_cpu_topology(), tiny_spec(), global_batch=8, seq_len=64, fixed=fixed)
    run = run_instructions(answer)
    predicted = run["overlapkit_train_predicted"]
    # The replicated head: more compute and more gradient bytes per rank, more memory.
    assert predicted["step_time_s"] > answer.best.step.step_s
    assert predicted["memory_gb_per_gpu"] > answer.best.memory.total / 1e9
    text = render_auto(answer, [], 0.0, run_instructions(answer))
    assert "overlapkit-train keeps the embeddings and head whole on every tp rank" in text
    dp_only = auto_plan(_cpu_topology(), tiny_spec(), global_batch=8, seq_len=64, fixed={"tp": 1})
    assert "overlapkit_train_predicted" not in run_instructions(dp_only)


def test_layouts_overlapkit_train_lacks_say_what():
    # The search's best layout with pp and cp fixed, which overlapkit-train refuses together.
    answer = auto_plan(
        load_topology("dgx-h100x4"),
        "llama3-70b",
        global_batch=64,
        seq_len=8192,
        fixed={"pp": 2, "cp": 2},
    )
    layout = answer.best.layout
    assert "pipeline with context parallelism" in OVERLAPKIT_TRAIN.lacks(layout)
    with pytest.raises(ValueError, match=r"does not run .*pipeline with context parallelism"):
        train_overrides(layout, topology="dgx-h100x4", nodes=4, ranks_per_node=8, model=None)
    assert "overlapkit-train lacks" in render_auto(answer, [], 0.0, run_instructions(answer))


def _mesh_of_auto_plan(rank: int, world_size: int) -> tuple:
    topology = load_topology("cpu-gloo").with_accelerator(measured_accelerator(0.05, memory_GB=8))
    settings = SearchSettings(accelerator=topology.accelerator)
    placement = ok.plan(
        topology, model=tiny_spec(), global_batch=4, seq_len=64, auto=True, settings=settings
    )
    mesh = placement.device_mesh("cpu")
    assert dist.get_world_size() == 2
    return mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist())


@pytest.mark.slow
def test_auto_placement_builds_its_device_mesh_on_real_ranks():
    names, ranks = run_on_ranks(_mesh_of_auto_plan, 2)[0]
    assert names == ("pp", "dp", "ep", "cp", "tp") and sorted(ranks) == [0, 1]
