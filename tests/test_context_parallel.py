"""Context parallelism (``parallel.plan.cp``): the load-balanced split, the checks, and cp layouts
on 4 gloo ranks against one process running the whole sequences."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import overlapkit as ok
from overlapkit.group.process_group import group_timeout
from overlapkit.train.models import GPT, GPTConfig, MLPConfig, MoEConfig
from overlapkit.train.parallel.context_parallel import (
    WholeSequences,
    check_sequence_split,
    chunk_positions,
    split_sequences,
)
from overlapkit.train.parallel.mesh import PlanConfig, build_layout, data_shard
from overlapkit.train.parallel.recompute import apply_recompute
from overlapkit.train.parallel.run_layout import check_parallel
from overlapkit.train.parallel.wrappers import apply_parallel
from overlapkit.train.run.loop import TrainConfig
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks
from tests.one_process_layouts import COLLECTIVE_TIMEOUT_S

GPT_SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=16)
SEQ = 16
MICRO = 2  # micro-batches per step: the first under no_sync


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_position_is_held_once_and_causal_work_is_balanced(cp):
    seq_len = 2 * cp * 3
    held = [chunk_positions(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    # A query at position p attends to p + 1 keys: every rank gets the same number of pairs.
    assert len({int((h + 1).sum()) for h in held}) == 1
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]  # torch's head-tail layout
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_a_sequence_that_2cp_does_not_divide_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"cp=3: .* 2 x cp = 6 chunks, which must divide data."):
        check_sequence_split(3, 64)
    with pytest.raises(ValueError, match=r"cp=2 splits token sequences; the data has none"):
        check_sequence_split(2, None)
    check_sequence_split(2, 64)
    check_sequence_split(1, 7)


@pytest.mark.parametrize(
    ("plan", "model", "message"),
    [
        (dict(cp=3), GPTConfig(), r"tp x parallel.plan.ep x parallel.plan.cp = 1 x 1 x 3 = 3 doe"),
        (dict(cp=2), MLPConfig(), r"cp=2 splits the sequences of a transformer"),
        (dict(cp=2, ep=2), MoEConfig(), r"cp \(2\) with parallel.plan.ep \(2\)"),
        (dict(cp=2, dp_shard=2), GPTConfig(), r"cp \(2\) with parallel.plan.dp_shard \(2\)"),
    ],
)
def test_cp_layouts_the_loop_cannot_run_are_refused(plan, model, message):
    # The wrapper that runs the other dimension: GradBucketer for ep, ok.fsdp for dp_shard.
    target = "overlapkit.fsdp" if "dp_shard" in plan else "overlapkit.GradBucketer"
    with pytest.raises(ValueError, match=message):
        check_parallel(
            PlanConfig.of(**plan),
            {"_target_": target},
            TrainConfig(),
            world_size=4,
            model_config=model,
            seq_len=64,
        )


def test_ranks_of_one_cp_group_read_the_same_batch_shard():
    cp = ok.plan(ok.load_topology("cpu-gloox2"), cp=2)
    shards = [data_shard(cp, r) for r in range(4)]
    for group in cp.groups("cp"):
        assert len({shards[r] for r in group}) == 1
    assert sorted(set(shards)) == [(0, 2), (1, 2)]


def test_without_cp_the_model_sees_whole_sequences():
    model = GPT(GPTConfig(**GPT_SMALL))
    split = split_sequences(model, None, torch.device("cpu"))
    assert isinstance(split, WholeSequences)
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    with split.shard(tokens, tokens) as (inputs, targets):
        assert inputs == (tokens,) and targets is tokens


def _batch(shard: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * shard + micro)
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


# name -> (plan sizes, factory, recompute mode)
CASES = {
    "cp_dp ok.ddp": (dict(cp=2), functools.partial(ok.ddp), "none"),
    "cp_dp ok.ddp full recompute": (dict(cp=2), functools.partial(ok.ddp), "full"),
    "cp4 ok.ddp": (dict(cp=4), functools.partial(ok.ddp), "none"),
    "cp_dp ok.fsdp": (dict(cp=2), functools.partial(ok.fsdp), "none"),
    "cp_dp ok.fsdp zero2": (dict(cp=2), functools.partial(ok.fsdp, zero=2), "selective"),
    "cp_dp bucketer_overlap": (
        dict(cp=2),
        functools.partial(ok.GradBucketer, optimizer="optim"),
        "none",
    ),
    "cp_tp GradBucketer": (dict(cp=2, tp=2), functools.partial(ok.GradBucketer), "selective"),
    # Overlapped tp under selective recomputation: the ring's transfers are functional
    # collectives the recomputation replays from its cache, in the forward's order.
    "cp_tp ring GradBucketer": (
        dict(cp=2, tp=2, tp_comm="ring"),
        functools.partial(ok.GradBucketer),
        "selective",
    ),
    "hsdp zero1": (dict(dp_shard=2), functools.partial(ok.fsdp, zero=1), "none"),
}


def _cp_layouts_match_the_whole_sequences(rank: int, world_size: int) -> dict:
    topology = ok.load_topology("cpu-gloox2")
    device = torch.device("cpu")
    layouts = {}
    out = {}
    for name, (sizes, factory, recompute) in CASES.items():
        plan = PlanConfig.of(**sizes)
        key = tuple(sorted(sizes.items()))
        if key not in layouts:  # one mesh (and its gloo groups) per plan
            layouts[key] = build_layout(plan, topology, device)
        layout = layouts[key]
        torch.manual_seed(0)
        reference = GPT(GPTConfig(**GPT_SMALL))
        torch.manual_seed(0)
        model = GPT(GPTConfig(**GPT_SMALL))
        split = split_sequences(model, layout.cp_mesh, device)
        apply_recompute(model.blocks, recompute)
        par = apply_parallel(model, factory, layout, make_optimizer=_sgd)
        shard, shards = layout.data_shard(rank, world_size)

        loss_sum = torch.zeros(())
        for micro in range(MICRO):
            inputs, targets = _batch(shard, micro)
            with (
                par.no_sync() if micro < MICRO - 1 else contextlib.nullcontext(),
                split.shard(inputs, targets) as (model_inputs, local_targets),
            ):
                loss = GPT.loss(par.model(*model_inputs), local_targets) / MICRO
                loss.backward()
            loss_sum += loss.detach()
        reported = split.average_loss(loss_sum).item()
        par.finish_backward()
        par.settle()

        # One process, whole sequences: the mean over every shard and micro-batch.
        losses = {
            (s, m): GPT.loss(reference(_batch(s, m)[0]), _batch(s, m)[1])
            for s in range(shards)
            for m in range(MICRO)
        }
        (sum(losses.values()) / len(losses)).backward()
        own_loss = sum(losses[shard, m].item() for m in range(MICRO)) / MICRO
        if par.optimizer is not None:  # the bucketer stepped (and zeroed) itself: compare params
            _sgd(reference.parameters()).step()
            compared = {n: (_full(p.detach()), p) for n, p in par.model.named_parameters()}
            expected = {n: p.detach() for n, p in reference.named_parameters()}
        else:
            compared = {n: (_full(p.grad), p) for n, p in par.model.named_parameters()}
            expected = {n: p.grad for n, p in reference.named_parameters()}
        gap = 0.0
        for param_name, (value, _) in compared.items():
            param_name = param_name.removeprefix("module.")  # ok.ddp's DDP wrapper
            torch.testing.assert_close(
                value,
                expected[param_name],
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, n=param_name, c=name: f"{c} {n}: {m}",
            )
            gap = max(gap, (value - expected[param_name]).abs().max().item())
        flattened = plan.sizes.cp > 1
        out[name] = {
            # The flattened dp x cp group the wrappers reduce over: the default group's timeout.
            "timeout": group_timeout(layout.dp_group).total_seconds() if flattened else None,
            "shards": shards,
            "loss": (reported, own_loss),
            "max_abs_diff": gap,
            "description": par.description + split.description,
        }
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first test to use one_process_layouts runs it
def test_cp_layouts_on_4_ranks_equal_one_process_on_whole_sequences(one_process_layouts):
    results = one_process_layouts[0]["cp"]
    for rank, result in enumerate(results):
        for name, case in result.items():
            sizes = CASES[name][0]
            # One batch shard per dp rank: tp and cp ranks read the same one.
            assert case["shards"] == 4 // (sizes.get("tp", 1) * sizes.get("cp", 1)), name
            reported, own = case["loss"]
            # The loss reported under cp is the whole sequences' mean, not the rank's chunks'.
            assert reported == pytest.approx(own, rel=1e-5), (rank, name)
            if "cp" in sizes:
                assert case["timeout"] == COLLECTIVE_TIMEOUT_S, name  # the harness's
                assert f"context parallel cp={sizes['cp']} (K/V all-gather)" in case["description"]
    print({name: f"{case['max_abs_diff']:.1e}" for name, case in results[0].items()})
    assert "ZeRO-2" in results[0]["cp_dp ok.fsdp zero2"]["description"]
    assert (
        "sequence parallel tp=2, tp_comm=ring"
        in results[0]["cp_tp ring GradBucketer"]["description"]
    )
    assert "ok.fsdp (HSDP) ZeRO-1" in results[0]["hsdp zero1"]["description"]


def _torch_cp_matches_whole_sequences(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**GPT_SMALL)).to(device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SMALL)).to(device)
    split = split_sequences(model, mesh, device)
    inputs, targets = (t.to(device) for t in _batch(0, 0))
    with split.shard(inputs.clone(), targets.clone()) as (model_inputs, local_targets):
        loss = GPT.loss(model(*model_inputs), local_targets)
        loss.backward()
    for p in model.parameters():  # what DDP over cp would do
        dist.all_reduce(p.grad)
        p.grad /= world_size
    GPT.loss(reference(inputs), targets).backward()
    expected = dict(reference.named_parameters())
    gap = 0.0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-5)
        gap = max(gap, (p.grad - expected[name].grad).abs().max().item())
    return {"torch_cp": split.torch_cp, "max_abs_diff": gap}


@requires_cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (cp=2 over NCCL); `make test-gpu`"
)
def test_cuda_cp_through_torch_context_parallel_equals_whole_sequences():
    results = run_on_ranks(
        _torch_cp_matches_whole_sequences, 2, backend="nccl", collective_timeout_s=60
    )
    assert all(r["torch_cp"] for r in results)
    print(results)
