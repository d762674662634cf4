"""What the planner's step-time model is told about this machine, measured on its ranks.

``bench.planner_ranking`` predicts each layout with ``autoplan.step_time.StepOptions`` whose
host terms are measured here first, every rank at once (the cores are shared, as in the
training steps), each figure the slowest rank's median:

- ``compute_calibration``: the model's FLOP rate (its forward and backward, no communication)
  and ``tp_layer_dispatch_s``, what overlapkit-train's tensor-parallel plan costs the host per
  layer pass at the same FLOPs (the plan on a one-rank mesh against the plain model);
- ``collective_overhead``: ``collective_overhead_s``, what one collective call costs between
  ranks that come from computing;
- ``optimizer_calibration``: ``optimizer_tensor_s``, ``optimizer_dtensor_s`` and
  ``optimizer_param_s``, the AdamW step's cost per plain and per DTensor parameter tensor and
  per parameter;
- ``overlap_calibration``: ``overlap_efficiency``, the share of a forward and backward that an
  all-reduce over the rate-limited link hides behind.

All are collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import overlapkit as ok
from overlapkit.train.parallel import apply_tensor_parallel


def slowest_medians(samples: Sequence[Sequence[float]]) -> list[float]:
    """Each series' median on this rank, then the largest over the ranks (a collective)."""
    medians = torch.tensor([statistics.median(s) for s in samples], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


def one_rank_group() -> dist.ProcessGroup:
    """This rank's own group (a collective: every rank creates every one-rank group)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


def forward_backward_s(model: torch.nn.Module, inputs, targets) -> float:
    start = time.perf_counter()
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    return time.perf_counter() - start


def compute_calibration(
    make_model: Callable[[], torch.nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    flops: float,
    layers: int,
    tensor_parallel: bool,
    alone: dist.ProcessGroup,
    steps: int,
) -> tuple[float, float]:
    """(FLOP/s, tp dispatch s per layer pass) of one rank's forward and backward.

    The rate: ``flops`` over the plain model's micro-batch. The dispatch (``tensor_parallel``
    models): the same model under overlapkit-train's tensor-parallel plan on a mesh of this
    rank alone (``alone``), so the same FLOPs and no transfer, minus the plain time, per layer
    and pass. The two alternate; the dispatch is the median of the paired differences.
    """
    models = [make_model()]
    if tensor_parallel:
        models.append(make_model())
        apply_tensor_parallel(
            models[1], DeviceMesh.from_group(alone, "cpu", mesh_dim_names=("tp",))
        )
    plain_s, extra_s = [], []
    for i in range(steps + 2):
        pair = [forward_backward_s(m, inputs, targets) for m in models]
        if i >= 2:
            plain_s.append(pair[0])
            if len(pair) == 2:  # paired: noise between steps hits both alike
                extra_s.append(pair[1] - pair[0])
    plain, extra = slowest_medians([plain_s, extra_s or [0.0]])
    return flops / plain, max(0.0, extra) / (2 * layers)


def collective_overhead(topology: ok.Topology, *, probes: int, work: int) -> dict[str, float]:
    """Seconds a tiny all-reduce between two ranks that come from computing takes.

    On this shared machine a collective waits for its peers to be scheduled: with every rank
    busy that costs milliseconds, not the microseconds an idle calibration measures, and a
    layout with many collectives (tp's per layer, FSDP's per block, ep's per MoE layer) pays
    it each time. Measured per tier: a node's two ranks, and one rank of each node (across the
    link), ``work`` matmuls (about a layer's compute) before each call.
    """
    nodes = topology.nodes()
    in_node = [dist.new_group(list(n)) for n in nodes]
    across = [dist.new_group([nodes[0][i], nodes[1][i]]) for i in range(len(nodes[0]))]
    rank = dist.get_rank()
    node = topology.devices[rank].node
    local = topology.devices[rank].local_index
    matrix = torch.randn(256, 256)
    probe = torch.zeros(1)
    out = {}
    for tier, group in (("scale_up", in_node[node]), ("scale_out", across[local])):
        times = []
        for _ in range(probes):
            for _ in range(work):
                matrix = torch.tanh(matrix @ matrix)
            start = time.perf_counter()
            dist.all_reduce(probe, group=group)
            times.append(time.perf_counter() - start)
        (out[tier],) = slowest_medians([times])
    return out


def optimizer_calibration(
    model: torch.nn.Module, *, alone: dist.ProcessGroup, steps: int
) -> dict[str, float]:
    """The AdamW step's cost per parameter tensor (plain, DTensor) and per parameter, seconds.

    Three optimizers over as many tensors as ``model`` has parameters, stepped in turn (so
    that noise hits them alike): one-element plain tensors (``optimizer_tensor_s``: the
    per-tensor loop), one-element DTensors sharded on a mesh of this rank alone, as FSDP2's are
    (``optimizer_dtensor_s``: each operation through DTensor's dispatch) and the model's own
    shapes as plain tensors (``optimizer_param_s``: the difference over its parameters, the
    arithmetic). torch's AdamW steps CPU tensors one by one (no fused or foreach kernel).
    """
    shapes = [p.shape for p in model.parameters()]
    count, elements = len(shapes), sum(s.numel() for s in shapes)
    mesh = DeviceMesh.from_group(alone, "cpu", mesh_dim_names=("dp",))
    sets = {
        "plain": [torch.nn.Parameter(torch.zeros(1)) for _ in shapes],
        "dtensor": [
            torch.nn.Parameter(
                DTensor.from_local(torch.zeros(1), mesh, [Shard(0)], run_check=False)
            )
            for _ in shapes
        ],
        "full": [torch.nn.Parameter(torch.zeros(s)) for s in shapes],
    }
    optimizers = []
    for params in sets.values():
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizers.append(torch.optim.AdamW(params, lr=1e-4))
    times: list[list[float]] = [[] for _ in optimizers]
    for i in range(steps + 2):
        for optimizer, series in zip(optimizers, times, strict=True):
            start = time.perf_counter()
            optimizer.step()
            if i >= 2:  # the first steps allocate the moments
                series.append(time.perf_counter() - start)
    plain, dtensor, full = slowest_medians(times)
    return {
        "optimizer_tensor_s": plain / count,
        "optimizer_dtensor_s": dtensor / count,
        "optimizer_param_s": max(0.0, full - plain) / elements,
    }


def overlap_calibration(model: torch.nn.Module, inputs, targets, *, trials: int) -> dict:
    """The share of a forward and backward that all-reduces over every rank hide behind.

    All-reduces of ``model``'s gradient bytes over the world group (across the link), as many
    as take 1.5 times the compute, so that the window is the limit: timed alone (``comm``),
    the forward and backward alone (``window``) and the two together, the all-reduces started
    asynchronously first (``both``). ``overlap_efficiency`` is ``(comm + window - both) /
    window``, in [0, 1]: 1 when the compute runs as if the transfers were not there.
    """
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    forward_backward_s(model, inputs, targets)
    start = time.perf_counter()
    dist.all_reduce(grads)
    one, window = slowest_medians(
        [[time.perf_counter() - start], [forward_backward_s(model, inputs, targets)]]
    )
    transfers = max(1, math.ceil(1.5 * window / one))

    def communicate(wait: bool) -> list[dist.Work]:
        works = [dist.all_reduce(grads, async_op=True) for _ in range(transfers)]
        if wait:
            for work in works:
                work.wait()
        return works

    comm_s, window_s, both_s = [], [], []
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        communicate(wait=True)
        comm_s.append(time.perf_counter() - start)
        dist.barrier()
        window_s.append(forward_backward_s(model, inputs, targets))
        dist.barrier()
        start = time.perf_counter()
        works = communicate(wait=False)
        forward_backward_s(model, inputs, targets)
        for work in works:
            work.wait()
        both_s.append(time.perf_counter() - start)
    comm, window, both = slowest_medians([comm_s, window_s, both_s])
    efficiency = min(1.0, max(0.0, (comm + window - both) / window))
    return {
        "transfers": transfers,
        "comm_s": comm,
        "window_s": window,
        "both_s": both,
        "overlap_efficiency": efficiency,
    }
