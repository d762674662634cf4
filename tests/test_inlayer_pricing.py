"""The planner's price of the in-layer modes (``parallel.plan.ep_chunks``, ``tp_comm``): the
pipeline formulas, steps priced from their parts (cost model, GEMM model, extra calls), the
search keeping the fastest mode and handing it to the run."""

from __future__ import annotations

import dataclasses

import pytest

from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.gemm import GemmRates, gemms_pass_seconds, routed_expert_gemms
from overlapkit.autoplan.group_costs import AxisCosts, LayoutCollectives
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.pipelined_comm import one_sided_exposed, pipelined_exposed, ring_exposed
from overlapkit.autoplan.step_time import StepOptions, StepRates, predict_step
from overlapkit.layout import TrainingLayout
from overlapkit.topology import bare_link
from overlapkit.topology.accelerator import Accelerator

GPU = Accelerator(name="test", memory_GB=80, peak_bf16_tflops=1000, sms=None)
MIXTRAL = load_model("mixtral-8x7b")
LAYOUT = TrainingLayout(ep=8, dp=1, micro_batch=1, num_micro_batches=1)


@pytest.mark.parametrize(
    ("comm", "compute", "chunks", "exposed"),
    [
        (1.0, 5.0, 1, 2.0),  # one chunk: synchronous, all of it exposed
        (1.0, 0.5, 2, 3.0),  # 2 + (1 - 0.5) under each chunk (one exchange in flight each)
        (1.0, 3.0, 3, 2.0),  # compute hides every middle exchange: the first and last remain
        (1.0, 0.0, 3, 6.0),  # nothing to hide behind: every one of the 2 x 3 exchanges
        (1.0, 1.5, 3, 2.5),  # the middle chunk has two in flight (2 - 1.5), the ends one each
    ],
)
def test_pipelined_exposure_follows_its_formula(comm, compute, chunks, exposed):
    assert pipelined_exposed(comm, compute, chunks) == pytest.approx(exposed)
    # Never more hidden than the compute, never more exposed than every exchange.
    total = 2 * chunks * comm
    assert total - chunks * compute <= exposed <= total


def _options(chunks: int) -> StepOptions:
    return StepOptions(
        seq_len=4096,
        accelerator=GPU,
        achievable=0.5,
        overlap_efficiency=0.9,
        framework=OVERLAPKIT_TRAIN,
        ep_chunks=chunks,
    )


def test_chunked_ep_is_priced_from_the_cost_model_the_gemm_model_and_the_pipeline():
    topology = bare_link(25.0, 10.0, 8).with_accelerator(GPU)  # 25 GB/s, 10 us
    costs = AxisCosts(topology)
    sync = predict_step(MIXTRAL, LAYOUT, _options(1), costs)
    assert sync.hidden_share == {} and sync.ep_s > 0
    for chunks in (2, 4):
        step = predict_step(MIXTRAL, LAYOUT, _options(chunks), costs)
        # Rebuilt here from the parts the docstring names.
        collectives = LayoutCollectives(costs, LAYOUT)
        tokens = 4096
        ep_bytes = tokens * MIXTRAL.hidden * MIXTRAL.dispatch_copies * 2
        comm = collectives("all_to_all", ep_bytes / chunks, "ep")
        rates: GemmRates = StepRates.of(_options(chunks)).matmul
        (full_f, full_b), (part_f, part_b) = (
            gemms_pass_seconds(routed_expert_gemms(MIXTRAL, rows, tp=1, ep=8, cp=1), rates)
            for rows in (tokens, tokens / chunks)
        )
        per_layer = pipelined_exposed(comm, part_f, chunks) + pipelined_exposed(
            comm, part_b, chunks
        )
        per_layer += max(0.0, chunks * (part_f + part_b) - full_f - full_b)
        assert step.ep_s == pytest.approx(MIXTRAL.moe_layers * per_layer, rel=1e-9)
        total = MIXTRAL.moe_layers * 2 * 2 * chunks * comm
        share = step.hidden_share["ep"]
        assert share == pytest.approx(max(0.0, 1 - step.ep_s / total), rel=1e-9)
        assert 0 < share < 1
        assert step.ep_s < sync.ep_s  # a slow link under large experts: chunking pays
        assert step.to_dict()["hidden_share"] == {"ep": share}


def test_chunking_tiny_experts_on_a_high_latency_link_costs_more_than_it_hides():
    topology = bare_link(25.0, 5000.0, 8).with_accelerator(GPU)  # 5 ms per call
    costs = AxisCosts(topology)
    sync, chunked = (predict_step(MIXTRAL, LAYOUT, _options(c), costs) for c in (1, 8))
    assert chunked.ep_s > sync.ep_s  # the extra launches' latency is not hidden


def test_the_search_prices_every_chunk_count_keeps_the_fastest_and_hands_it_to_the_run():
    from overlapkit.autoplan.handoff.run_config import train_overrides
    from overlapkit.autoplan.search import Pricing
    from overlapkit.autoplan.settings import SearchSettings

    topology = bare_link(25.0, 10.0, 8).with_accelerator(GPU)
    searched = Pricing.of(topology, MIXTRAL, 4096, SearchSettings(framework=OVERLAPKIT_TRAIN))
    layout = LAYOUT
    options = searched.modes(layout)
    assert [o.ep_chunks for o in options] == list(OVERLAPKIT_TRAIN.ep_chunk_choices) == [1, 2, 4]
    best = searched.candidate(layout, searched.memory(layout)).step
    each = {o.ep_chunks: predict_step(MIXTRAL, layout, o, searched.costs) for o in options}
    fastest = min(each, key=lambda n: each[n].step_s)
    assert best.modes == {"ep_chunks": fastest} and best.step_s == each[fastest].step_s
    # A run's own ep_chunks is priced as given (overlapkit-train's measured vs predicted).
    fixed = SearchSettings(framework=OVERLAPKIT_TRAIN, ep_chunks=2)
    assert [o.ep_chunks for o in Pricing.of(topology, MIXTRAL, 4096, fixed).modes(layout)] == [2]
    # Megatron-LM's all-to-alls are not chunked: one mode, the synchronous one.
    assert len(Pricing.of(topology, MIXTRAL, 4096, SearchSettings()).modes(layout)) == 1
    overrides = train_overrides(
        layout, topology="t", nodes=1, ranks_per_node=8, model=None, modes=best.modes
    )
    assert f"parallel.plan.ep_chunks={fastest}" in overrides
    # tp: every mode, split only where tp_chunks (2) divides the micro-batch.
    modes = {
        mb: [o.tp_comm for o in searched.modes(TrainingLayout(tp=8, micro_batch=mb))]
        for mb in (1, 2)
    }
    assert modes == {1: ["sync", "ring"], 2: ["sync", "split", "ring"]}


@pytest.mark.parametrize(
    ("comm", "compute", "pieces", "one_sided", "ring"),
    [
        (1.0, 2.0, 2, 1.0, 0.0),  # split: only the first gather; ring: every transfer hidden
        (1.0, 0.25, 4, 1.0 + 3 * 0.75, 3 * 0.75),  # the link is slower than the pieces
        (1.0, 0.0, 3, 3.0, 2.0),  # nothing to hide behind
    ],
)
def test_tp_pipelines_follow_their_formulas(comm, compute, pieces, one_sided, ring):
    assert one_sided_exposed(comm, compute, pieces) == pytest.approx(one_sided)
    assert ring_exposed(comm, compute, pieces) == pytest.approx(ring)


def test_tp_modes_are_priced_from_their_pieces_and_gloo_scatters_cost_an_all_reduce():
    from overlapkit.autoplan.micro_batch import StageMicroBatch, tensor_parallel
    from overlapkit.topology.model import Library

    llama = load_model("llama3-8b")
    layout = TrainingLayout(tp=8, dp=1)
    for library in (Library.IDEAL, Library.GLOO):
        link = dataclasses.replace(bare_link(25.0, 10.0, 8), library=library)
        topology = link.with_accelerator(GPU)
        costs = AxisCosts(topology)
        collectives = LayoutCollectives(costs, layout)
        stage = StageMicroBatch.of(
            llama, layout, framework=OVERLAPKIT_TRAIN, precision=_options(1).precision, seq_len=4096
        )
        rates = StepRates.of(_options(1)).matmul
        tp_bytes = 4096 * llama.hidden * 2
        scatter = "all_reduce" if library is Library.GLOO else "reduce_scatter"
        sync = tensor_parallel(stage, collectives, overlap=0.0)
        per_pass = 2 * (
            collectives("all_gather", tp_bytes, "tp") + collectives(scatter, tp_bytes, "tp")
        )
        edges = 2 * collectives("all_gather", tp_bytes, "tp")
        assert sync.total_s == pytest.approx(llama.layers * 2 * per_pass + edges, rel=1e-9)
        for mode in ("split", "ring"):
            got = tensor_parallel(stage, collectives, overlap=0.0, mode=mode, chunks=2, rates=rates)
            # Every piece's call priced by the cost model: 4 fused steps per layer pass, split
            # in 2 chunks of each collective, ring in tp - 1 neighbour transfers of 1/tp.
            if mode == "split":
                pieces = 2 * (
                    collectives("all_gather", tp_bytes / 2, "tp")
                    + collectives(scatter, tp_bytes / 2, "tp")
                )
            else:
                pieces = 4 * 7 * collectives("send_recv", tp_bytes / 8, "tp")
            pieces *= 2 if mode == "split" else 1
            assert got.total_s == pytest.approx(llama.layers * 2 * pieces + edges, rel=1e-9)
            assert 0 < got.exposed_s < got.total_s
            priced = predict_step(
                llama,
                layout,
                dataclasses.replace(_options(1), tp_comm=mode, tp_chunks=2),
                costs,
            )
            assert priced.tp_s == pytest.approx(got.exposed_s, rel=1e-9)
            assert priced.modes == (
                {"tp_comm": mode} | ({"tp_chunks": 2} if mode == "split" else {})
            )
            assert priced.hidden_share["tp"] == pytest.approx(
                max(0.0, 1 - got.exposed_s / got.total_s), rel=1e-9
            )
