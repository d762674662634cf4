"""Pinning what a run does: every choice the search varies, on the CLI and in ``ok.plan``; the
winner written back as a CLI and an ``ok.plan`` call that price exactly it; ``--framework``
as both the price and the layouts searched; the ``gpt:`` model shape; bad values in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import overlapkit as ok
from overlapkit.autoplan.framework import FRAMEWORKS, MEGATRON, OVERLAPKIT_TRAIN
from overlapkit.autoplan.handoff.run_config import train_overrides
from overlapkit.autoplan.models import gpt_spec, load_model
from overlapkit.autoplan.ok_plan import auto_plan
from overlapkit.autoplan.pins import pins_from
from overlapkit.autoplan.published_runs import check_run, published_runs
from overlapkit.autoplan.search import price, search
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.cli import main
from overlapkit.layout import PartialLayout, TrainingLayout
from overlapkit.topology import load_topology
from overlapkit.train.planning.parallel_auto import AutoConfig

GPT = "gpt:layers=8,hidden=1024,heads=16"
BASE = ["plan", "--auto", "--topology", "dgx-a100", "--model", GPT]
BATCH = ["--global-batch", "32", "--seq-len", "2048"]
SC21 = "gpt:layers=24,hidden=2304,heads=24"


def _json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def free_best() -> dict:
    """The free search's winner as ``--json`` has it: each pin below differs from it."""
    answer = auto_plan(load_topology("dgx-a100"), GPT, global_batch=32, seq_len=2048)
    return answer.best.to_dict()


# (flags, what the winner must show); the free winner is tp1 pp1 dp8, mb 4, none, fsdp.
CLI_PINS = [
    (["--tp", "2"], {"dims.tp": 2}),
    (["--pp", "2"], {"dims.pp": 2}),
    (["--dp", "4"], {"dims.dp": 4}),
    (["--micro-batch", "1"], {"micro_batch": 1}),
    (["--virtual-stages", "2"], {"virtual_stages": 2}),
    (["--recompute", "selective"], {"recompute": "selective"}),
    (["--recompute", "full"], {"recompute": "full"}),
    (["--recompute", "full:3"], {"recompute": "full", "recompute_layers": 3}),
    (["--recompute", "full:all"], {"recompute": "full", "recompute_layers": None}),
    (["--sharding", "zero2"], {"sharding": "zero2"}),
    (["--dp-shard", "2"], {"sharding": "hsdp", "dp_shard": 2}),
    (["--sharding", "hsdp", "--dp-shard", "2"], {"sharding": "hsdp", "dp_shard": 2}),
]


def _field(candidate: dict, key: str):
    for part in key.split("."):
        candidate = candidate[part]
    return candidate


@pytest.mark.parametrize(("flags", "expected"), CLI_PINS)
def test_each_choice_pinned_on_the_cli_is_the_winners(capsys, free_best, flags, expected):
    # Control: the free winner has another value, so the pin is what sets it.
    assert any(_field(free_best, k) != v for k, v in expected.items())
    doc = _json(capsys, [*BASE, *BATCH, *flags])
    assert {k: _field(doc["candidates"][0], k) for k in expected} == expected


def test_the_cli_ok_plan_and_parallel_pins_pin_one_partial_layout_which_json_prints(capsys):
    expected = PartialLayout(
        tp=2, recompute="full", recompute_layers=3, sharding="hsdp", dp_shard=2
    )
    doc = _json(capsys, [*BASE, *BATCH, "--tp", "2", "--recompute", "full:3", "--dp-shard", "2"])
    assert PartialLayout(**doc["fixed"]) == expected
    keywords = {"tp": 2, "recompute": "full:3", "dp_shard": 2}
    assert pins_from(keywords) == expected  # ok.plan(..., auto=True, **keywords)
    assert AutoConfig(pins=keywords).fixed() == expected  # +parallel.pins.tp=2 ...
    assert expected.admits(
        ok.plan(
            load_topology("dgx-a100"),
            model=GPT,
            global_batch=32,
            seq_len=2048,
            auto=True,
            **keywords,
        ).training
    )


def test_attention_and_framework_pinned_on_the_cli_price_and_filter(capsys):
    doc = _json(capsys, [*BASE, *BATCH, "--attention", "softmax", "--tp", "2"])
    assert (doc["attention"], doc["framework"]) == ("softmax", "megatron")
    assert doc["candidates"][0]["sharding"] == "fsdp"  # Megatron runs tp under FSDP
    flash = _json(capsys, [*BASE, *BATCH, "--tp", "2"])["candidates"][0]
    assert doc["candidates"][0]["step_time_s"] > flash["step_time_s"]
    doc = _json(capsys, [*BASE, *BATCH, "--framework", "overlapkit-train", "--tp", "2"])
    assert doc["framework"] == "overlapkit-train" and doc["refused"] > 0
    assert {c["sharding"] for c in doc["candidates"]} == {"ddp"}  # it has no tp under FSDP


@pytest.mark.parametrize(
    ("pins", "expected"),
    [
        ({"tp": 2}, {"tp": 2}),
        ({"pp": 2, "virtual_stages": 2}, {"pp": 2, "virtual_stages": 2}),
        ({"micro_batch": 1}, {"micro_batch": 1}),
        ({"recompute": "full", "recompute_layers": 3}, {"recompute_layers": 3}),
        ({"recompute": "full:3"}, {"recompute": "full", "recompute_layers": 3}),
        ({"recompute": "full", "recompute_layers": "all"}, {"recompute_layers": None}),
        ({"recompute": "selective"}, {"recompute": "selective"}),
        ({"sharding": "zero1"}, {"sharding": "zero1"}),
        ({"dp_shard": 2}, {"sharding": "hsdp", "dp_shard": 2}),
        ({"tp": 2, "framework": "overlapkit-train"}, {"tp": 2, "sharding": "ddp"}),
    ],
)
def test_each_choice_pinned_in_ok_plan_is_the_winners(pins, expected):
    placement = ok.plan(
        load_topology("dgx-a100"), model=GPT, global_batch=32, seq_len=2048, auto=True, **pins
    )
    assert {k: getattr(placement.training, k) for k in expected} == expected


def test_ok_plan_settings_keywords_reach_the_search():
    topology = load_topology("dgx-a100")
    settings = dict(attention="softmax", framework=OVERLAPKIT_TRAIN)
    answer = auto_plan(topology, GPT, global_batch=32, seq_len=2048, **settings)
    assert not answer.settings.flash_attention and answer.settings.framework is OVERLAPKIT_TRAIN
    assert SearchSettings(framework="overlapkit-train").framework is OVERLAPKIT_TRAIN
    assert set(FRAMEWORKS) == {"megatron", "overlapkit-train", "torchtitan"}


def test_the_pinned_command_prices_exactly_the_same_winner(capsys):
    flags = ["--recompute", "full:2", "--sharding", "hsdp", "--attention", "softmax"]
    first = _json(capsys, [*BASE, *BATCH, *flags, "--gpu-memory-gb", "40", "--achievable", "0.5"])
    command = first["run"]["plan_command"]
    assert command[:3] == ["overlapkit", "plan", "--auto"]
    assert {"--gpu-memory-gb", "--achievable", "--attention", "--framework"} <= set(command)
    again = _json(capsys, command[1:])
    assert again["candidates"][0] == first["candidates"][0]
    assert (again["attention"], again["framework"]) == ("softmax", "megatron")


def test_the_printed_ok_plan_line_runs_and_builds_the_winner(capsys):
    argv = [*BASE, *BATCH, "--recompute", "full:2", "--sharding", "hsdp", "--attention", "softmax"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("  from Python: ")).removeprefix("  from Python: ")
    assert "recompute='full', recompute_layers=2" in line and "attention='softmax'" in line
    namespace = {"ok": ok}
    exec(line, namespace)
    best = _json(capsys, argv)["candidates"][0]
    layout = namespace["plan"].training
    shown = {k: best[k] for k in ("micro_batch", "virtual_stages", "recompute", "sharding")}
    assert layout.dims == best["dims"]
    assert {k: getattr(layout, k) for k in shown} == shown
    assert (layout.recompute_layers, layout.dp_shard) == (2, best["dp_shard"])


def test_a_config_json_model_is_printed_as_its_path(capsys, tmp_path):
    path = tmp_path / "sc21.json"
    config = {"model_type": "gpt2", "n_layer": 8, "n_embd": 1024, "n_head": 16}
    path.write_text(json.dumps(config | {"n_positions": 2048, "vocab_size": 51200}))
    argv = ["plan", "--auto", "--topology", "dgx-a100", "--model", str(path), *BATCH]
    run = _json(capsys, argv)["run"]
    assert f"model={str(path)!r}" in run["plan_call"]
    assert eval(run["plan_call"], {"ok": ok}).training.global_batch == 32


def test_the_sc21_example_prices_exactly_the_published_layout(capsys):
    argv = ["plan", "--auto", "--topology", "dgx-a100x4", "--model", SC21, "--tp", "1"]
    argv += ["--pp", "1", "--dp", "32", "--recompute", "full:all", "--attention", "softmax"]
    argv += ["--sharding", "ddp", "--global-batch", "512", "--seq-len", "2048"]
    best = _json(capsys, argv)["candidates"][0]
    assert best["dims"] == {"tp": 1, "pp": 1, "dp": 32, "cp": 1, "ep": 1}
    assert (best["recompute"], best["recompute_layers"], best["sharding"]) == ("full", None, "ddp")
    # The same price as the validation table's row for it (Megatron-LM SC'21, 1.7B).
    row = next(r for r in published_runs() if r.name == "megatron-sc21-1.7B")
    predicted = check_run(row, free_search=False).predicted
    assert best["tokens_per_s_per_gpu"] == pytest.approx(predicted.tokens_per_s_per_gpu)


def test_overlapkit_train_never_proposes_what_it_refuses_and_megatron_does():
    topology = load_topology("dgx-a100")
    model = load_model("gpt:layers=8,hidden=1024,heads=16,experts=8,topk=2")
    kwargs = dict(global_batch=32, seq_len=2048, candidates=40)
    train = search(topology, model, settings=SearchSettings(framework="overlapkit-train"), **kwargs)
    assert train.refused > 0
    assert all(OVERLAPKIT_TRAIN.refusal(c.layout) is None for c in train.candidates)
    megatron = search(topology, model, **kwargs)
    assert megatron.refused == 0
    assert any(OVERLAPKIT_TRAIN.refusal(c.layout) for c in megatron.candidates)


def test_the_framework_refusal_names_each_thing_it_lacks():
    # What overlapkit-train refuses before launch (train/parallel/mesh.py, stages.py), one by one.
    lacks = {
        TrainingLayout(tp=2, ep=2): "tensor and expert parallelism together",
        TrainingLayout(tp=2, dp=2, sharding="fsdp"): "tensor parallelism under FSDP",
        TrainingLayout(tp=2, dp=2, sharding="zero1"): "tensor parallelism under FSDP (zero1)",
        TrainingLayout(ep=2, dp=4, sharding="hsdp", dp_shard=2): "expert parallelism under FSDP",
        TrainingLayout(ep=2, dp=2, sharding="zero2"): "expert parallelism under FSDP (zero2)",
        TrainingLayout(pp=2, ep=2, num_micro_batches=2): "pipeline with expert parallelism",
        TrainingLayout(pp=2, cp=2, num_micro_batches=2): "pipeline with context parallelism",
        TrainingLayout(pp=2, dp=2, num_micro_batches=2, sharding="zero2"): "zero2 under a pipeline",
        TrainingLayout(cp=2, ep=2): "context with expert parallelism",
        TrainingLayout(cp=2, dp=4, sharding="hsdp", dp_shard=2): "cp with hsdp",
        TrainingLayout(pp=2): "a pipeline of 2 stages with 1 micro-batches per step (fewer than "
        "its stages)",
    }
    for layout, reason in lacks.items():
        assert OVERLAPKIT_TRAIN.lacks(layout) == [reason]
        assert OVERLAPKIT_TRAIN.refusal(layout) == f"overlapkit-train does not run {reason}"
        assert MEGATRON.refusal(layout) is None
    uneven = TrainingLayout(pp=2, num_micro_batches=2, virtual_stages=2)
    assert OVERLAPKIT_TRAIN.lacks(uneven, layers=6) == [
        "6 layers in 4 pipeline chunks (unequal stages)"
    ]
    assert OVERLAPKIT_TRAIN.lacks(uneven, layers=8) == []
    runs = (
        TrainingLayout(tp=2, dp=2),
        TrainingLayout(pp=2, tp=2, num_micro_batches=2, recompute="selective"),
        TrainingLayout(pp=2, dp=2, num_micro_batches=2, sharding="zero1"),
        TrainingLayout(cp=2, dp=2, sharding="zero2", recompute="full", recompute_layers=1),
        TrainingLayout(cp=2, tp=2),
        TrainingLayout(pp=2, dp=4, num_micro_batches=2, sharding="hsdp", dp_shard=2),
    )
    assert all(OVERLAPKIT_TRAIN.refusal(layout) is None for layout in runs)


def test_recomputing_layouts_get_the_train_recompute_overrides():
    layout = TrainingLayout(dp=4, recompute="full", recompute_layers=3)
    args = dict(topology="dgx-a100", nodes=1, ranks_per_node=4, model="gpt_tiny")
    overrides = train_overrides(layout, **args)
    assert "train.recompute=full" in overrides and "train.recompute_layers=3" in overrides
    selective = dataclasses.replace(layout, recompute="selective", recompute_layers=None)
    overrides = train_overrides(selective, **args)
    assert "train.recompute=selective" in overrides
    assert not any(o.startswith("train.recompute_layers") for o in overrides)
    with pytest.raises(ValueError, match=r"does not run tensor parallelism under FSDP \(zero1\)"):
        train_overrides(TrainingLayout(tp=2, dp=2, sharding="zero1"), **args)


def test_recompute_layers_count_each_model_chunk_as_overlapkit_train_does():
    # pp 2 x v 2 of 8 layers: each rank holds 2 chunks of 2 layers; full:1 recomputes one layer
    # of each chunk (train.recompute_layers counts the blocks of each stage, a chunk), 2 of 4.
    layout = TrainingLayout(pp=2, num_micro_batches=2, virtual_stages=2, recompute="full")
    assert dataclasses.replace(layout, recompute_layers=1).recomputed_share(4) == 0.5
    assert dataclasses.replace(layout, recompute_layers=2).recomputed_share(4) == 1.0
    model = load_model("gpt:layers=8,hidden=1024,heads=16")
    pins = {"pp": 2, "virtual_stages": 2, "micro_batch": 1, "recompute": "full"}
    kwargs = dict(
        global_batch=16, seq_len=2048, settings=SearchSettings(framework="overlapkit-train")
    )
    topology = load_topology("dgx-a100")
    found = search(topology, model, fixed=pins | {"recompute_layers": 2}, **kwargs)
    assert found.best.layout.recompute_layers == 2
    with pytest.raises(ValueError, match="no variant of the fixed layout"):
        search(topology, model, fixed=pins | {"recompute_layers": 3}, **kwargs)


@dataclasses.dataclass(frozen=True)
class _RecomputesNothing:
    """A selective policy that keeps every activation and recomputes nothing."""

    name: str = "nothing"
    tp_all_gathers_recomputed: int = 0
    recomputes_attention_core: bool = False

    def kept_bytes_per_token(self, model, element_bytes, *, saved, moe_layer, tp, ep):
        return saved

    def rebuilt_bytes_per_token(self, model, element_bytes, *, moe_layer):
        return 0.0

    def extra_forward_s(self, model, *, matmul_s, attention_s, flash):
        return 0.0

    def extra_flops_per_token(self, model, seq_len):
        return 0.0


def test_selective_recomputation_is_priced_by_the_frameworks_policy():
    topology = load_topology("dgx-a100")
    model = load_model(GPT)
    layout = TrainingLayout(dp=8, micro_batch=4, recompute="selective")
    nothing = dataclasses.replace(MEGATRON, selective=_RecomputesNothing())

    def priced(framework, lay):
        settings = SearchSettings(flash_attention=False, framework=framework)
        return price(topology, model, lay, seq_len=2048, settings=settings)

    none = priced(MEGATRON, dataclasses.replace(layout, recompute="none"))
    core = priced(MEGATRON, layout)
    kept = priced(nothing, layout)
    # Megatron's attention core: less memory, a longer step, than recomputing nothing.
    assert core.memory.total < none.memory.total and core.step.step_s > none.step.step_s
    assert kept.memory.total == pytest.approx(none.memory.total)
    assert kept.step.step_s == pytest.approx(none.step.step_s)
    assert kept.step.hardware_flops == pytest.approx(none.step.hardware_flops)


def test_a_gpt_shape_is_megatrons_gpt():
    spec = load_model(SC21, seq_len=4096)
    assert spec.params == gpt_spec(name="x", layers=24, hidden=2304, heads=24, seq_len=4096).params
    assert load_model(f"{SC21},seq=1024").position_embeddings == 1024
    moe = load_model("gpt:layers=4,hidden=512,heads=8,ffn=1024,experts=8,topk=2")
    assert (moe.experts, moe.topk, moe.moe_ffn_hidden, moe.ffn_hidden) == (8, 2, 1024, 1024)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--recompute", "full:0"], "--recompute full:0"),
        (["--recompute", "full:x"], "--recompute full:x"),
        (["--recompute", "partial"], "--recompute 'partial'"),
        (["--recompute", "full:9"], "--recompute full:9"),
        (["--attention", "sdpa"], "--attention 'sdpa'"),
        (["--sharding", "zero3"], "--sharding 'zero3'"),
        (["--framework", "deepspeed"], "--framework 'deepspeed'"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--virtual-stages", "0"], "--virtual-stages"),
        (["--dp-shard", "2", "--sharding", "ddp"], "--dp-shard=2 goes with --sharding=hsdp"),
        (["--framework", "overlapkit-train", "--pp", "2", "--cp", "2"], "pipeline with context"),
        (["--framework", "overlapkit-train", "--tp", "2", "--sharding", "zero1"], "FSDP (zero1)"),
        (["--framework", "torchtitan", "--recompute", "full:2"], "recomputation of 2 layers"),
        (["--framework", "torchtitan", "--sharding", "zero1"], "zero1 optimizer-state"),
        (["--model", "gpt:layers=8,hidden=1024"], "missing heads="),
        (["--model", "gpt:layers=8,hidden=1000,heads=16"], "hidden (1000)"),
        (["--model", "gpt:layers=8,hidden=1024,heads=16,depth=2"], "'depth=2'"),
    ],
)
def test_a_bad_pin_is_one_line_naming_it(capsys, flags, named):
    assert main([*BASE, *BATCH, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


def test_pins_given_twice_or_without_full_are_refused_in_ok_plan():
    topology = load_topology("dgx-a100")
    kwargs = dict(model=GPT, global_batch=32, seq_len=2048, auto=True)
    with pytest.raises(ValueError, match="already says the layers"):
        ok.plan(topology, recompute="full:2", recompute_layers=3, **kwargs)
    with pytest.raises(ValueError, match="recompute_layers=2 goes with recompute=full"):
        ok.plan(topology, recompute="selective", recompute_layers=2, **kwargs)
    with pytest.raises(ValueError, match="goes with recompute=full"):
        ok.plan(topology, recompute_layers=2, **kwargs)


def _stable_keys_of_plan_auto() -> list[list[str]]:
    """The *stable* keys of docs/json-contracts.md's ``plan --auto`` tables, table by table."""
    text = (Path(__file__).parent.parent / "docs" / "json-contracts.md").read_text()
    section = text.split("## `plan --auto`")[1].split("\n## ")[0]
    tables: list[list[str]] = [[]]
    for line in section.splitlines():
        if not line.startswith("|"):
            if tables[-1]:
                tables.append([])
            continue
        if "*stable*" in line:
            tables[-1].append(line.split("`")[1])
    return [t for t in tables if t]


def test_plan_auto_json_has_every_stable_key_the_contract_lists(capsys):
    top, candidate, run = _stable_keys_of_plan_auto()
    doc = _json(capsys, [*BASE, *BATCH])  # a winner overlapkit-train runs: fsdp
    assert set(top) <= doc.keys()
    assert set(candidate) <= doc["candidates"][0].keys()
    assert set(run) <= doc["run"].keys()
    assert len(candidate) >= 15 and "recompute_layers" in candidate
