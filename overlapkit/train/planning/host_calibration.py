"""What the planner needs to know about a host whose ranks compute on it, measured there.

On a GPU the host runs ahead of the kernels; on CPU ranks (gloo) the host does the compute, and
per-operation costs the datasheet model of a GPU leaves out decide which layout is fastest.
``overlapkit calibrate --host`` measures them on the ranks of this machine, every rank at once
(the cores are shared, as in the training steps), each figure the slowest rank's median, and
writes a topology file whose ``accelerator`` section (``topology.accelerator.HostCosts``) the
planner prices a CPU run with (``overlapkit-train parallel=auto topology=preset
topology.name_or_path=FILE``, and the measured-vs-predicted line of every run on it):

- ``compute_calibration``: the model's FLOP rate (its forward and backward, no communication),
  the accelerator's peak, and ``tp_layer_dispatch_s``, what overlapkit-train's tensor-parallel
  plan costs the host per layer pass at the same FLOPs (the plan on a one-rank mesh against the
  plain model);
- ``collective_overhead``: ``collective_overhead_s``, what one collective call costs between
  ranks that come from computing;
- ``optimizer_calibration``: ``optimizer_tensor_s``, ``optimizer_dtensor_s`` and
  ``optimizer_param_s``, the AdamW step's cost per plain and per DTensor parameter tensor and
  per parameter;
- ``overlap_calibration``: ``overlap_efficiency``, the share of a forward and backward that an
  all-reduce over every rank hides behind;
- the links: ``overlapkit calibrate``'s all-reduce fits (``cost.calibrate``).

The model and micro-batch are overlapkit-train's (its Hydra overrides: ``model=...``,
``train.batch_size=...``): the rate of small matrices differs from large ones', so measure the
model you train. All are collectives: every rank calls them, in the same order.
``bench.planner_ranking`` measures the same terms with these functions.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from overlapkit.autoplan.models import train_model_spec
from overlapkit.cost.calibrate import calibrate_collective
from overlapkit.topology.model import Topology
from overlapkit.train.parallel.tensor_parallel import apply_tensor_parallel
from overlapkit.workers.local_ranks import run_on_ranks


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


def collective_overhead(topology: Topology, *, probes: int, work: int) -> dict[str, float]:
    """Seconds a tiny all-reduce between two ranks that come from computing takes.

    On this shared machine a collective waits for its peers to be scheduled: with every rank
    busy that costs milliseconds, not the microseconds an idle calibration measures, and a
    layout with many collectives (tp's per layer, FSDP's per block, ep's per MoE layer) pays
    it each time. Measured per tier: a node's ranks, and one rank of each node (across the
    link), where there are several, ``work`` matmuls (about a layer's compute) before each call.
    """
    nodes = topology.nodes()
    # new_group is collective: every rank creates every group, used or not.
    in_node = [dist.new_group(list(n)) for n in nodes]
    across = [dist.new_group([n[i] for n in nodes]) for i in range(len(nodes[0]))]
    rank = dist.get_rank()
    node = topology.devices[rank].node
    local = topology.devices[rank].local_index
    matrix = torch.randn(256, 256)
    probe = torch.zeros(1)
    out = {}
    tiers = [("scale_up", in_node[node])] if len(nodes[0]) > 1 else []
    tiers += [("scale_out", across[local])] if len(nodes) > 1 else []
    for tier, group in tiers:
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


@dataclass(frozen=True, slots=True)
class HostWorkload:
    """The model and micro-batch the host is measured with (overlapkit-train's config)."""

    model: dict
    """The ``model`` group, resolved (``_target_`` and ``config``)."""
    batch_size: int
    """Sequences per rank per micro-batch (``train.batch_size``)."""
    seq_len: int
    """Tokens per sequence (``data.seq_len``)."""

    def make_model(self) -> torch.nn.Module:
        """The model, seeded alike on every rank."""
        torch.manual_seed(0)
        return instantiate(self.model)

    def batch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of random tokens."""
        vocab = self.model["config"]["vocab_size"]
        generator = torch.Generator().manual_seed(100 + rank)
        idx = torch.randint(vocab, (self.batch_size, self.seq_len + 1), generator=generator)
        return idx[:, :-1], idx[:, 1:]


def host_workload(overrides: Sequence[str]) -> HostWorkload:
    """The ``model``, ``train.batch_size`` and ``data.seq_len`` overlapkit-train composes from
    ``overrides`` (its own spelling: ``model=moe_tiny``, ``model.config.n_embd=256``).

    Raises:
        ValueError: a model without attention (the planner prices transformers).
    """
    with initialize_config_module("overlapkit.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if "n_head" not in model["config"]:
        raise ValueError(
            f"overlapkit calibrate --host measures a transformer (model=gpt_tiny or moe_tiny); "
            f"{model['_target_']} has no attention"
        )
    seq_len = cfg.data.get("seq_len") or model["config"]["block_size"]
    return HostWorkload(model=model, batch_size=int(cfg.train.batch_size), seq_len=int(seq_len))


@dataclass(frozen=True, slots=True)
class HostEffort:
    """How long each measurement runs (repetitions; the medians are kept)."""

    steps: int = 11
    probes: int = 30
    probe_work: int = 2
    overlap_trials: int = 5
    optimizer_steps: int = 31


def measure_host(
    workload: HostWorkload, topology: Topology, effort: HostEffort = HostEffort()
) -> dict[str, float]:
    """Every host term of ``workload`` on this job's ranks (a collective; see module doc).

    Returns:
        dict: ``flops_per_s`` (the model's rate per rank) and ``HostCosts``' fields, seconds.
    """
    config = instantiate(workload.model["config"])
    inputs, targets = workload.batch(dist.get_rank())
    tokens = workload.batch_size * workload.seq_len
    spec = train_model_spec(config, name="host")
    alone = one_rank_group()
    rate, dispatch = compute_calibration(
        workload.make_model,
        inputs,
        targets,
        flops=spec.model_flops_per_token(workload.seq_len) * tokens,
        layers=config.n_layer,
        tensor_parallel=True,
        alone=alone,
        steps=effort.steps,
    )
    overhead = collective_overhead(topology, probes=effort.probes, work=effort.probe_work)
    overlap = overlap_calibration(
        workload.make_model(), inputs, targets, trials=effort.overlap_trials
    )
    return {
        "flops_per_s": rate,
        "tp_layer_dispatch_s": dispatch,
        "collective_overhead_s": max(overhead.values(), default=0.0),
        "overlap_efficiency": overlap["overlap_efficiency"],
        **optimizer_calibration(workload.make_model(), alone=alone, steps=effort.optimizer_steps),
    }


def accelerator_section(terms: dict[str, float], *, ranks_per_node: int) -> dict:
    """The ``accelerator:`` section of a measured host (``topology.accelerator``)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_node

    def us(key: str) -> str:
        return f"{terms[key] * 1e6:.6g}us"

    return {
        "accelerator": {
            "name": "measured-host",
            "memory": f"{memory / 1e9:.4g}GB",
            "peak_bf16_tflops": float(f"{terms['flops_per_s'] / 1e12:.6g}"),
            "host": {
                "collective_overhead": us("collective_overhead_s"),
                "tp_layer_dispatch": us("tp_layer_dispatch_s"),
                "optimizer_tensor": us("optimizer_tensor_s"),
                "optimizer_dtensor": us("optimizer_dtensor_s"),
                "optimizer_param": us("optimizer_param_s"),
                "overlap_efficiency": round(terms["overlap_efficiency"], 4),
            },
        }
    }


def host_topology_text(
    calibration_yaml: str, terms: dict[str, float], workload: HostWorkload
) -> str:
    """``overlapkit calibrate``'s topology file with the measured host's accelerator section."""
    nodes = yaml.safe_load(calibration_yaml)
    section = accelerator_section(terms, ranks_per_node=nodes["devices_per_node"])
    shape = ", ".join(f"{k}={v}" for k, v in workload.model["config"].items() if k != "_target_")
    lines = [
        "# accelerator: measured by `overlapkit calibrate --host` with "
        f"{workload.model['_target_']} ({shape}),",
        f"# {workload.batch_size} x {workload.seq_len} tokens per rank, every rank at once; its "
        "peak is that model's forward and backward",
        "# rate (fp32), taken as achieved; host: per-operation costs (topology/accelerator.py).",
    ]
    return calibration_yaml + "\n".join(lines) + "\n" + yaml.safe_dump(section, sort_keys=False)


def _host_worker(
    rank: int,
    world_size: int,
    workload: HostWorkload,
    sizes: list[int],
    options: dict,
    effort: HostEffort,
) -> tuple[str, dict] | None:
    result = host_calibration(workload, sizes, options, effort)
    return result if rank == 0 else None


def host_calibration(
    workload: HostWorkload, sizes: Sequence[int], options: dict, effort: HostEffort
) -> tuple[str, dict]:
    """(topology file text, measured terms) of this job's ranks; a collective."""
    calibration = calibrate_collective(sizes, **options)
    terms = measure_host(workload, calibration.topology, effort)
    return host_topology_text(calibration.yaml_text, terms, workload), terms


def calibrate_host(
    overrides: Sequence[str],
    *,
    ranks: int,
    sizes: Sequence[int],
    options: dict,
    effort: HostEffort = HostEffort(),
) -> tuple[str, dict]:
    """Measure this host (the links and every host term, see module doc) for the model and
    micro-batch ``overrides`` give overlapkit-train; (topology file text, terms).

    Inside an initialised job (torchrun) its ranks are measured; otherwise ``ranks`` local gloo
    workers are spawned. ``sizes`` and ``options`` are ``overlapkit calibrate``'s (``cost.
    calibrate.calibrate_collective``).

    Raises:
        ValueError: a model without attention; ``ranks`` below 2.
        RankFailure: a worker raised or died.
    """
    workload = host_workload(overrides)
    if dist.is_available() and dist.is_initialized():
        return host_calibration(workload, sizes, options, effort)
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 to measure collectives, got {ranks}")
    return run_on_ranks(
        _host_worker,
        ranks,
        workload,
        list(sizes),
        options,
        effort,
        collective_timeout_s=300,
        total_timeout_s=1800,
    )[0]
