"""autoplan.search: the auto-planner's search, its constraints and its refusals."""

import dataclasses
from itertools import pairwise

import pytest

from overlapkit.autoplan.memory import memory_breakdown
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.search import TIE, search
from overlapkit.autoplan.settings import PlanSearchError, with_memory
from overlapkit.layout import TrainingLayout
from overlapkit.topology import load_topology

H100x4 = load_topology("dgx-h100x4")
LLAMA8B = load_model("llama3-8b")


def test_free_search_ranks_fitting_layouts_by_step_time():
    result = search(H100x4, LLAMA8B, global_batch=64, seq_len=8192, candidates=5)
    times = [c.step.step_s for c in result.candidates]
    # Times within TIE of each other tie, and the simpler layout goes first.
    assert all(a <= b * (1 + TIE) for a, b in pairwise(times))
    assert all(c.fits for c in result.candidates)
    assert result.searched >= result.timed >= len(result.candidates)


def test_free_search_keeps_tensor_parallel_inside_a_node():
    result = search(H100x4, load_model("llama3-70b"), global_batch=64, seq_len=8192)
    assert all(c.layout.tp <= 8 for c in result.candidates)


def test_fixed_sizes_constrain_the_search_and_leave_the_rest_free():
    result = search(H100x4, LLAMA8B, global_batch=64, seq_len=8192, fixed={"tp": 2})
    assert {c.layout.tp for c in result.candidates} == {2}
    assert len({(c.layout.pp, c.layout.sharding) for c in result.candidates}) > 1


def test_all_sizes_fixed_reports_the_best_variant_even_when_it_does_not_fit():
    small = with_memory(load_topology("dgx-h100"), 16)
    fixed = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}
    result = search(small, LLAMA8B, global_batch=8, seq_len=8192, fixed=fixed, candidates=1)
    assert not result.best.fits and result.best.memory.total > 16e9


def test_fixed_sizes_where_nothing_fits_list_the_variant_closest_to_fitting():
    # A 71B GPT (64 heads, every one a key/value head: tp 16 splits them evenly).
    model = load_model("gpt:layers=88,hidden=8192,heads=64,seq=4096")
    fixed = {"tp": 16}
    result = search(load_topology("dgx-h100x2"), model, global_batch=64, seq_len=4096, fixed=fixed)
    # Every variant left free (micro-batch, recomputation; dp = 1 leaves no sharding choice).
    needs = [
        memory_breakdown(
            model,
            TrainingLayout(tp=16, micro_batch=mb, num_micro_batches=64 // mb, recompute=r),
            seq_len=4096,
        ).total
        for mb in (1, 2, 4, 8, 16, 32, 64)
        for r in ("none", "selective", "full")
    ]
    listed = [c.memory.total for c in result.candidates]
    assert not any(c.fits for c in result.candidates)
    assert listed == sorted(listed) and listed[0] == pytest.approx(min(needs))
    assert max(needs) > 5 * min(needs)  # the fastest variant needs far more


def test_a_model_that_fits_nowhere_is_refused_with_the_smallest_need():
    with pytest.raises(PlanSearchError, match=r"llama3-405b .* fits nowhere on dgx-h100 .*needs"):
        search(load_topology("dgx-h100"), load_model("llama3-405b"), global_batch=8, seq_len=8192)


def test_a_batch_no_layout_divides_is_refused_naming_it():
    with pytest.raises(PlanSearchError, match=r"--global-batch 7 is not divisible"):
        search(H100x4, LLAMA8B, global_batch=7, seq_len=8192, fixed={"dp": 2})


def test_fixed_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(PlanSearchError, match=r"tp=3 = 3 does not divide the 32 GPUs"):
        search(H100x4, LLAMA8B, global_batch=64, seq_len=8192, fixed={"tp": 3})


def test_tensor_parallel_sizes_divide_the_attention_and_key_value_heads():
    # GPT-2 small's 12 heads on 8-GPU domains: tp 8 would split heads across ranks.
    gpt2 = load_model("gpt:layers=12,hidden=768,heads=12")
    free = search(H100x4, gpt2, global_batch=512, seq_len=2048, candidates=200)
    assert {c.layout.tp for c in free.candidates} == {1, 2, 4}
    with pytest.raises(PlanSearchError, match=r"tp=8 does not divide .* 12 attention heads"):
        search(H100x4, gpt2, global_batch=512, seq_len=2048, fixed={"tp": 8})
    gqa = dataclasses.replace(LLAMA8B, name="gqa2", kv_heads=2)
    with pytest.raises(PlanSearchError, match=r"tp=8 does not divide gqa2's 32 .* 2 key/value"):
        search(H100x4, gqa, global_batch=64, seq_len=8192, fixed={"tp": 8})


def test_expert_parallel_is_searched_for_moe_models_only():
    dense = search(H100x4, LLAMA8B, global_batch=64, seq_len=4096, candidates=20)
    assert {c.layout.ep for c in dense.candidates} == {1}
    moe = search(H100x4, load_model("mixtral-8x7b"), global_batch=64, seq_len=4096, candidates=20)
    assert all(8 % c.layout.ep == 0 for c in moe.candidates)


def test_a_topology_without_accelerator_figures_is_refused_with_advice():
    with pytest.raises(PlanSearchError, match="has no accelerator section"):
        search(load_topology("cpu-gloo"), LLAMA8B, global_batch=8, seq_len=1024)


def test_fp8_on_a_gpu_without_fp8_is_refused():
    from overlapkit.autoplan.memory import FP8
    from overlapkit.autoplan.settings import SearchSettings

    with pytest.raises(ValueError, match="no FP8 peak"):
        search(
            load_topology("dgx-a100x4"),
            LLAMA8B,
            global_batch=64,
            seq_len=4096,
            settings=SearchSettings(precision=FP8),
        )
