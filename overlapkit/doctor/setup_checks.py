"""Checks of the setup, as pure functions of what was detected: topology, collective algorithms
(and the environment forcing them), placement. NIC affinity is in ``doctor.affinity``.

Each ``check_*`` takes recorded facts (a ``Topology``, rank views, an environment mapping) and
returns a ``Check``; nothing here needs a process group, so the classification is tested on
recorded inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from overlapkit.cost.estimate import estimate
from overlapkit.doctor.check import FAIL, PASS, WARN, Check, worst
from overlapkit.layout import PartialLayout
from overlapkit.planner.explain import where
from overlapkit.planner.grid import rail_aligned
from overlapkit.planner.placement import PlacementError, plan
from overlapkit.topology.model import DeviceKind, Topology
from overlapkit.topology.units import format_bytes, rank_ranges

# Environment variables the communication libraries read for interface choice.
IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# NCCL's algorithm and protocol names (NCCL_ALGO / NCCL_PROTO, case-insensitive), and the cost
# model's algorithm each maps to (None: not modelled; PAT only runs with one rank per node).
NCCL_ALGOS = {
    "ring": "ring",
    "tree": "tree",
    "nvls": "switch",
    "nvlstree": "switch",
    "collnetdirect": "switch",
    "collnetchain": "switch",
    "pat": None,
}
NCCL_PROTOS = ("ll", "ll128", "simple")
# Settings that take a path or a choice away from NCCL: value that restricts -> what it costs.
RESTRICTING = {
    "NCCL_NVLS_ENABLE": ("0", "NVLink SHARP (in-switch reduction) is off"),
    "NCCL_P2P_DISABLE": ("1", "GPU peer-to-peer (NVLink/PCIe) is off: traffic goes through host"),
    "NCCL_SHM_DISABLE": ("1", "shared-memory transport is off"),
    "NCCL_IB_DISABLE": ("1", "InfiniBand/RoCE is off: inter-node traffic uses TCP sockets"),
    "NCCL_COLLNET_ENABLE": ("0", "CollNet (SHARP in the network) is off"),
    "NCCL_MAX_NCHANNELS": (None, "the number of channels (parallel rings) is capped"),
    "NCCL_NET_GDR_LEVEL": (None, "GPUDirect RDMA distance is overridden"),
}
ALGORITHM_SIZES = (64 * 2**10, 2**20, 16 * 2**20, 256 * 2**20)
"""Message sizes (bytes) the algorithm check predicts for."""


# ----------------------------------------------------------------------------------------
# 1. topology and what the communication library will see


def matching_interfaces(spec: str, interfaces: Sequence[str], *, variable: str) -> list[str]:
    """The interfaces a ``*_SOCKET_IFNAME`` value selects.

    NCCL: comma-separated prefixes, ``=name`` for an exact name, a leading ``^`` to exclude.
    Gloo: comma-separated exact names.
    """
    spec = spec.strip()
    if variable.startswith("GLOO"):
        names = [s.strip() for s in spec.split(",") if s.strip()]
        return [i for i in interfaces if i in names]
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    patterns = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [i for i in interfaces if hit(i) != exclude]


def _describe(topology: Topology) -> str:
    kinds = Counter(str(d.kind) for d in topology.devices)
    domains = "; ".join(
        f"{d.kind} ranks {rank_ranges(d.ranks)} ({d.achieved_GBps:.3g} GB/s)"
        for d in topology.domains
    )
    fabric = topology.fabric
    return (
        f"{' + '.join(f'{n} {k}' for k, n in kinds.items())} device(s) on "
        f"{topology.num_nodes} node(s); {len(topology.domains)} domain(s): {domains}; "
        f"{fabric.nics_per_node} NIC(s)/node, {fabric.transport} {fabric.nic_GBps:g} GB/s"
    )


def topology_mismatches(detected: Topology, expected: Topology) -> list[str]:
    """How ``detected`` differs from the ``expected`` topology in shape (empty when it matches)."""
    out = []
    if detected.world_size != expected.world_size:
        out.append(f"world size {detected.world_size}, expected {expected.world_size}")
    if detected.num_nodes != expected.num_nodes:
        out.append(f"{detected.num_nodes} node(s), expected {expected.num_nodes}")
    shape = sorted((str(d.kind), len(d.ranks)) for d in detected.domains)
    want = sorted((str(d.kind), len(d.ranks)) for d in expected.domains)
    if shape != want:
        out.append(f"domains (kind, ranks) {shape}, expected {want} from {expected.name!r}")
    kinds = {str(d.kind) for d in detected.devices}
    want_kinds = {str(d.kind) for d in expected.devices}
    if kinds != want_kinds:
        out.append(f"device kind {sorted(kinds)}, expected {sorted(want_kinds)}")
    return out


def check_topology(
    detected: Topology,
    *,
    backend: str,
    env: Mapping[str, str],
    interfaces: Sequence[str],
    expected: Topology | None = None,
) -> Check:
    """Check 1: the topology is recognised, and what the communication library will see.

    Args:
        detected (Topology): ``detect_topology()`` over the job's ranks.
        backend (str): the process group's backend (``gloo``, ``nccl``).
        env (Mapping[str, str]): the ranks' environment (``NCCL_*``, ``GLOO_*``).
        interfaces (Sequence[str]): network interface names on this host.
        expected (Topology): the topology the user expects (``--topology``); a shape mismatch
            fails.
    """
    findings: list[tuple[str, str]] = []
    details: dict[str, Any] = {
        "backend": backend,
        "world_size": detected.world_size,
        "nodes": detected.num_nodes,
        "domains": [
            {"kind": str(d.kind), "ranks": list(d.ranks), "achieved_GBps": d.achieved_GBps}
            for d in detected.domains
        ],
        "nics_per_node": detected.fabric.nics_per_node,
        "env": {k: env[k] for k in IFNAME_VARIABLES if k in env},
    }
    if expected is not None:
        for line in topology_mismatches(detected, expected):
            findings.append((FAIL, f"topology mismatch: {line}"))
    gpus = any(d.kind is DeviceKind.GPU for d in detected.devices)
    if gpus and backend != "nccl":
        findings.append((WARN, f"GPUs detected but the backend is {backend}: use nccl"))
    for variable in IFNAME_VARIABLES:
        if variable not in env:
            continue
        chosen = matching_interfaces(env[variable], interfaces, variable=variable)
        if not chosen:
            findings.append(
                (
                    FAIL,
                    f"{variable}={env[variable]!r} matches no interface here "
                    f"({', '.join(interfaces) or 'none'}): the library cannot open sockets",
                )
            )
    ifname = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if detected.num_nodes > 1 and ifname not in env:
        findings.append(
            (
                WARN,
                f"{ifname} is unset on a {detected.num_nodes}-node job: the library picks "
                "an interface itself, which may be a slow or unreachable one",
            )
        )
    seen = ", ".join(f"{k}={v}" for k, v in details["env"].items()) or "no *_SOCKET_IFNAME set"
    value = f"{_describe(detected)}; backend {backend}, world size {detected.world_size}; {seen}"
    status = worst(s for s, _ in findings)
    advice = (
        "; ".join(text for _, text in findings)
        if findings
        else "recognised; pass --topology NAME|FILE to compare it with what you expect"
        if expected is None
        else f"matches {expected.name!r}"
    )
    if status == FAIL and expected is not None and any("mismatch" in t for _, t in findings):
        advice += (
            ". Check that every node started its ranks (torchrun --nnodes/--nproc-per-node) "
            "and that the expected topology is the right one"
        )
    return Check("topology", status, value, advice, details)


# ----------------------------------------------------------------------------------------
# 4. algorithm per message size, and the environment forcing one


def parse_nccl_list(value: str, valid: Sequence[str]) -> tuple[set[str], list[str]]:
    """The names an ``NCCL_ALGO`` / ``NCCL_PROTO`` value allows (lower case), and unknown ones.

    Accepts ``Ring,Tree``, ``^Tree`` (all but), and per-collective ``allreduce:ring;...``
    (the union over collectives is returned).
    """
    allowed: set[str] = set()
    unknown: list[str] = []
    for part in value.split(";"):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            part = part.split(":", 1)[1]
        exclude = part.startswith("^")
        names = [n.strip().lower() for n in part.lstrip("^").split(",") if n.strip()]
        unknown += [n for n in names if n not in valid]
        chosen = {n for n in names if n in valid}
        allowed |= (set(valid) - chosen) if exclude else chosen
    return allowed, unknown


FORCED_SLOWDOWN_SHOWN = 1.005
"""A forced algorithm is reported as slower only beyond this ratio of the unforced time: a
fraction of a percent is below what the cost model can tell apart (and prints as +0%)."""


def check_algorithms(
    topology: Topology,
    *,
    backend: str,
    env: Mapping[str, str],
    sizes: Sequence[int] = ALGORITHM_SIZES,
) -> Check:
    """Check 4: the cost model's all-reduce algorithm per message size, and env forcing one.

    ``NCCL_ALGO`` / ``NCCL_PROTO`` with an unknown name fail; a valid one warns, with the
    predicted slowdown against the unforced choice; other restricting ``NCCL_*`` settings warn.
    """
    findings, algos, protos = _nccl_env_findings(env)
    rows = _algorithm_rows(topology, sizes, algos, protos)
    if algos is not None or protos is not None:
        forcing = ", ".join(f"{k}={env[k]}" for k in ("NCCL_ALGO", "NCCL_PROTO") if k in env)
        if not any(s == FAIL for s, _ in findings):
            findings.append((WARN, f"{forcing} forces the choice{_forced_slowdowns(rows)}"))
        if backend != "nccl":
            findings.append((PASS, f"(the {backend} backend ignores NCCL_* settings)"))
    value = f"{topology.library} all_reduce over {topology.world_size} ranks: " + ", ".join(
        f"{format_bytes(r['bytes'])} -> {r['algorithm']}/{r['protocol']}" for r in rows
    )
    status = worst(s for s, _ in findings)
    advice = "; ".join(t for _, t in findings) or (
        "nothing forces the algorithm; the library picks per message size"
    )
    if status != PASS:
        advice += ". Unset NCCL_ALGO/NCCL_PROTO unless a measurement shows they help"
    return Check("algorithms", status, value, advice, {"sizes": rows})


def _nccl_env_findings(
    env: Mapping[str, str],
) -> tuple[list[tuple[str, str]], set[str] | None, set[str] | None]:
    """(findings, the algorithms ``NCCL_ALGO`` allows, the protocols ``NCCL_PROTO`` allows):
    an unknown name fails, a restricting ``NCCL_*`` setting warns; None where not set."""
    findings: list[tuple[str, str]] = []
    algos = protos = None
    if "NCCL_ALGO" in env:
        algos, unknown = parse_nccl_list(env["NCCL_ALGO"], list(NCCL_ALGOS))
        if unknown or not algos:
            findings.append(
                (
                    FAIL,
                    f"NCCL_ALGO={env['NCCL_ALGO']!r}: unknown algorithm(s) {unknown}; valid: "
                    f"{', '.join(NCCL_ALGOS)} (case-insensitive, ^ to exclude)",
                )
            )
    if "NCCL_PROTO" in env:
        protos, unknown = parse_nccl_list(env["NCCL_PROTO"], NCCL_PROTOS)
        if unknown or not protos:
            findings.append(
                (
                    FAIL,
                    f"NCCL_PROTO={env['NCCL_PROTO']!r}: unknown protocol(s) {unknown}; valid: "
                    "LL, LL128, Simple",
                )
            )
    for variable, (bad, what) in RESTRICTING.items():
        if variable in env and (bad is None or env[variable].strip() == bad):
            findings.append((WARN, f"{variable}={env[variable]}: {what}"))
    return findings, algos, protos


def _algorithm_rows(
    topology: Topology,
    sizes: Sequence[int],
    algos: set[str] | None,
    protos: set[str] | None,
) -> list[dict]:
    """Per message size, the cost model's all-reduce choice and time, and where ``algos`` or
    ``protos`` restrict the choice, the fastest candidate they allow (``forced``; None if none)."""
    modelled = {NCCL_ALGOS[a] for a in algos or ()} - {None}
    rows = []
    for size in sizes:
        auto = estimate("all_reduce", nbytes=size, topology=topology)
        row = {
            "bytes": size,
            "algorithm": auto.algorithm,
            "protocol": auto.protocol,
            "time_s": auto.time_s,
        }
        if auto.candidates and (algos is not None or protos is not None):
            allowed = [
                c
                for c in auto.candidates
                if (algos is None or c[0] in modelled) and (protos is None or c[1] in protos)
            ]
            row["forced"] = None
            if allowed:
                algorithm, protocol, time_s = allowed[0]
                row["forced"] = {"algorithm": algorithm, "protocol": protocol, "time_s": time_s}
        rows.append(row)
    return rows


def _forced_slowdowns(rows: list[dict]) -> str:
    """What forcing costs, per size where the forced choice is slower than
    ``FORCED_SLOWDOWN_SHOWN``, for the warning's tail."""
    slower = [
        f"{format_bytes(row['bytes'])}: {forced['algorithm']}/{forced['protocol']} "
        f"{forced['time_s'] / row['time_s'] - 1:+.0%} vs {row['algorithm']}"
        for row in rows
        if (forced := row.get("forced"))
        and forced["time_s"] > row["time_s"] * FORCED_SLOWDOWN_SHOWN
    ]
    if not slower:
        return "; the cost model predicts no slowdown at these sizes"
    return "; predicted " + "; ".join(slower)


# ----------------------------------------------------------------------------------------
# 7. placement

INNER_AXES = ("tp", "cp", "ep")
OUTER_AXES = ("dp", "pp")


def check_placement(topology: Topology, sizes: PartialLayout) -> Check:
    """Check 7: tp/cp/ep inside one scale-up domain, dp/pp rail-aligned, for a layout.

    Uses ``ok.plan`` on ``sizes`` (a size not given is 1, dp the rest; its validation refuses
    a layout that splits a domain) and ``explain.where`` for where each axis's groups live.
    """
    placed = sizes.placement_sizes()
    given = " ".join(f"{axis}={placed[axis]}" for axis in ("tp", "ep", "cp", "pp"))
    try:
        placement = plan(topology, **placed)
    except PlacementError as err:
        return Check(
            "placement",
            FAIL,
            f"{given} on {topology.name!r}: refused",
            str(err),
            {"suggestions": err.suggestions},
        )
    except ValueError as err:
        return Check("placement", FAIL, f"{given} on {topology.name!r}: invalid", str(err))
    findings: list[tuple[str, str]] = []
    lines = []
    for axis, size in placement.dims.items():
        if size <= 1 or axis not in placement.mesh_dim_names:
            continue
        groups = placement.groups(axis)
        spans = max(len({topology.domain_index(r) for r in g}) for g in groups)
        lines.append(f"{axis}={size} {where(placement, axis)}")
        if axis in INNER_AXES and spans > 1:
            findings.append(
                (
                    WARN,
                    f"{axis}={size} spans {spans} scale-up domains: its per-layer traffic "
                    "crosses the network; make it fit one domain",
                )
            )
        crosses_rails = spans > 1 and topology.fabric.nics_per_node > 1
        if (
            axis.startswith(OUTER_AXES)
            and crosses_rails
            and not all(rail_aligned(topology, g) for g in groups)
        ):
            findings.append(
                (
                    WARN,
                    f"{axis} groups are not rail-aligned: peers use different NIC "
                    "indices and meet at the spine",
                )
            )
    value = f"{placement.layout} layout on {topology.name!r}: " + (
        "; ".join(lines) or f"one dp group of {placement.world_size} rank(s)"
    )
    advice = "; ".join(t for _, t in findings) or (
        "tp/cp/ep stay inside a scale-up domain and dp/pp peers share rails"
    )
    return Check(
        "placement", worst(s for s, _ in findings), value, advice, {"dims": placement.dims}
    )
