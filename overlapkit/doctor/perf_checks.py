"""Checks of measured performance, as pure functions of the measurements: collective bandwidth
against the catalogue, bucket size against auto-tuning, exposed communication, scaling.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from overlapkit.doctor.check import FAIL, PASS, WARN, Check
from overlapkit.doctor.scaling import efficiencies
from overlapkit.topology.units import format_bytes

BANDWIDTH_PASS = 0.7
"""Measured / predicted bus bandwidth at or above this passes."""
BANDWIDTH_FAIL = 0.3
"""Below this fails (against a specified catalogue; a nominal one only warns)."""
BANDWIDTH_HIGH = 1.5
"""Above this the catalogue underestimates the machine: warn, calibrate."""
TUNED_TOLERANCE = 0.05
"""A bucket size or prefetch depth whose step is within 5 % of auto-tuning's choice passes."""
EXPOSED_SHARE_PASS = 0.10
"""Exposed comm up to this share of the step passes."""
SCALING_PASS = 0.8


def not_applicable(name: str, why: str, advice: str) -> Check:
    """A check that cannot run here (one rank, nothing to measure): a warning saying why."""
    return Check(name, WARN, f"not measured: {why}", advice)


def check_bandwidth(
    measured: Sequence[Mapping[str, float]],
    *,
    predicted_busbw_GBps: float,
    reference: str,
    nominal: bool,
    fit: tuple[float, float] | None = None,
) -> Check:
    """Check 3: measured all-reduce bus bandwidth at the largest size vs the catalogue's.

    Args:
        measured (Sequence[Mapping]): per size ``bytes``, ``time_s``, ``busbw_GBps``, smallest
            first (``calibrate.measure_all_reduce``).
        predicted_busbw_GBps (float): the cost model's bus bandwidth for the largest size on
            the reference topology, GB/s.
        reference (str): the topology the prediction used (for the message).
        nominal (bool): the catalogue figures are nominal (the CPU preset's round numbers), so a
            shortfall warns instead of failing.
        fit (tuple): fitted (latency us per step, bandwidth GB/s), if the fit succeeded.
    """
    largest = measured[-1]
    ratio = largest["busbw_GBps"] / predicted_busbw_GBps
    value = (
        f"{largest['busbw_GBps']:.3g} GB/s busbw at {format_bytes(largest['bytes'])} "
        f"({ratio:.0%} of {predicted_busbw_GBps:.3g} GB/s predicted for {reference!r})"
    )
    if fit is not None:
        value += f"; fit: {fit[0]:.3g} us per step, {fit[1]:.3g} GB/s per rank"
    details = {
        "sizes": [dict(m) for m in measured],
        "predicted_busbw_GBps": predicted_busbw_GBps,
        "ratio": ratio,
        "fit": None if fit is None else {"latency_us": fit[0], "bandwidth_GBps": fit[1]},
    }
    calibrate = (
        "run `overlapkit calibrate` and pass the topology file it writes as --topology, so that "
        "the cost model uses measured figures"
    )
    if ratio >= BANDWIDTH_HIGH:
        return Check(
            "bandwidth", WARN, value, f"faster than the catalogue says: {calibrate}", details
        )
    if ratio >= BANDWIDTH_PASS:
        return Check("bandwidth", PASS, value, "within reach of the catalogue figure", details)
    if nominal:
        return Check(
            "bandwidth",
            WARN,
            value,
            f"the catalogue figure is nominal (no specification exists for this link): {calibrate}",
            details,
        )
    status = FAIL if ratio < BANDWIDTH_FAIL else WARN
    advice = (
        "far below the link's catalogue figure: check the NIC/interface in use "
        "(NCCL_SOCKET_IFNAME, NCCL_IB_HCA), NCCL_P2P/IB_DISABLE, GPU clocks and PCIe width "
        "(nvidia-smi -q), and other jobs on the links"
        if status == FAIL
        else f"below the catalogue figure; if it persists on a quiet machine, {calibrate}"
    )
    return Check("bandwidth", status, value, advice, details)


def check_bucket_size(
    *,
    current_mb: float,
    current_step_ms: float | None,
    report: Any,
    explicit: bool,
    chosen_step_ms: float | None = None,
) -> Check:
    """Check 5a: the bucket size in use (MiB) vs what ``bucket_mb="auto"`` settles on.

    See ``check_tuned_setting`` for the arguments; ``current_mb`` is ``--bucket-mb`` or the
    default for the model.
    """
    return check_tuned_setting(
        name="bucket_size",
        option="bucket_mb",
        unit=" MiB",
        current=current_mb,
        current_step_ms=current_step_ms,
        report=report,
        explicit=explicit,
        chosen_step_ms=chosen_step_ms,
    )


def check_prefetch(
    *,
    current_depth: int,
    current_step_ms: float | None,
    report: Any,
    explicit: bool,
    chosen_step_ms: float | None = None,
) -> Check:
    """Check 5b: the ``ok.fsdp`` prefetch depth in use vs what ``prefetch="auto"`` settles on.

    See ``check_tuned_setting`` for the arguments; ``current_depth`` is ``--prefetch`` or 1,
    ``ok.fsdp``'s default.
    """
    return check_tuned_setting(
        name="prefetch",
        option="prefetch",
        unit="",
        current=current_depth,
        current_step_ms=current_step_ms,
        report=report,
        explicit=explicit,
        chosen_step_ms=chosen_step_ms,
    )


def check_tuned_setting(
    *,
    name: str,
    option: str,
    unit: str,
    current: float,
    current_step_ms: float | None,
    report: Any,
    explicit: bool,
    chosen_step_ms: float | None = None,
) -> Check:
    """A setting in use vs what auto-tuning of that setting settles on.

    Args:
        name (str): the check's name.
        option (str): the wrapper's keyword (``bucket_mb``, ``prefetch``), for the advice.
        unit (str): appended to values in the message (``" MiB"`` or ``""``).
        current (float): the value compared (the user's, or overlapkit's default).
        current_step_ms (float): median step time measured with ``current``, ms; None to use
            the tuner's own trial of that value, if it made one.
        report (TuningReport): ``ok.tuning_report(model)`` of an ``"auto"`` run (``trials`` of
            ``Trial(value, step_ms, exposed_ms)``, ``chosen``, ``settled``, ``reason``).
        explicit (bool): ``current`` came from the user (else it is overlapkit's default).
        chosen_step_ms (float): median step time with the chosen value measured the same way as
            ``current_step_ms``, ms; None to use the tuner's trial of the chosen value.
    """
    whose = f"your {option}" if explicit else f"the default {option}"
    trials = {float(t.value): t for t in report.trials}
    details = {
        "current": current,
        "current_step_ms": current_step_ms,
        "tuning": report.to_json(),
    }
    if not report.settled or report.chosen is None:
        return Check(
            name,
            WARN,
            f"auto-tuning did not settle ({len(trials)} trial(s)); {whose}={current:.3g}{unit}",
            f"tuning needs more steps than this run gave it ({report.reason}); run longer "
            f"(without --quick) or keep {option} as is",
            details,
        )
    chosen = float(report.chosen)
    chosen_trial = trials.get(chosen)
    value = f"{whose}={current:.3g}{unit}; auto chose {chosen:.3g}{unit} ({report.reason})"
    if abs(current - chosen) <= 1e-6 * max(chosen, 1.0):
        return Check(name, PASS, value, "auto-tuning agrees with the value in use", details)
    if current_step_ms is None and current in trials:
        current_step_ms = trials[current].step_ms
    if chosen_step_ms is None and chosen_trial is not None:
        chosen_step_ms = chosen_trial.step_ms
    details["chosen_step_ms"] = chosen_step_ms
    if current_step_ms is None or chosen_step_ms is None:
        return Check(
            name,
            WARN,
            value,
            f"no step time to compare; try {option}={chosen:g} or {option}='auto'",
            details,
        )
    gap = current_step_ms / chosen_step_ms - 1
    value += f"; step {current_step_ms:.4g} ms vs {chosen_step_ms:.4g} ms with auto's ({gap:+.1%})"
    if gap <= TUNED_TOLERANCE:
        return Check(
            name,
            PASS,
            value,
            f"at most {TUNED_TOLERANCE:.0%} slower than auto-tuning's choice; nothing to gain",
            details,
        )
    return Check(
        name,
        WARN,
        value,
        f"use {option}={chosen:g} (or {option}='auto', which settles in the first steps)",
        details,
    )


TAIL_SHARE = 0.5
"""``check_overlap`` blames the tail after backward (the last buckets) where it is at least this
share of the exposed time: most of it."""


def check_overlap(steps: Sequence[Mapping[str, float]]) -> Check:
    """Check 6: exposed communication and tail per step on a short profiled run.

    Args:
        steps (Sequence[Mapping]): ``StepMetrics.to_dict()`` rows of every rank and step
            (``step_ms``, ``comm_ms``, ``exposed_comm_ms``, ``tail_ms``).
    """
    if not steps:
        return not_applicable(
            "overlap",
            "the profiler recorded no step",
            "run longer than the profiler schedule (wait + warmup + active steps)",
        )

    def median(key: str) -> float:
        return statistics.median(float(s[key]) for s in steps)

    step_ms, comm_ms = median("step_ms"), median("comm_ms")
    exposed_ms, tail_ms = median("exposed_comm_ms"), median("tail_ms")
    share = exposed_ms / step_ms if step_ms > 0 else 0.0
    details = {
        "step_ms": step_ms,
        "comm_ms": comm_ms,
        "exposed_comm_ms": exposed_ms,
        "tail_ms": tail_ms,
        "exposed_share": share,
        "rank_steps": len(steps),
    }
    value = (
        f"median per step: {exposed_ms:.3g} ms of {comm_ms:.3g} ms comm exposed "
        f"({share:.0%} of a {step_ms:.3g} ms step), tail {tail_ms:.3g} ms "
        f"({len(steps)} rank-steps)"
    )
    if comm_ms <= 0:
        return Check(
            "overlap",
            WARN,
            value,
            "the profiler saw no collective: is the model wrapped (ok.ddp) and the world > 1?",
            details,
        )
    if share <= EXPOSED_SHARE_PASS:
        return Check("overlap", PASS, value, "communication is hidden behind compute", details)
    where = (
        "most of it is the tail after backward: smaller last buckets (bucket_mb='auto') help"
        if tail_ms >= TAIL_SHARE * exposed_ms
        else "it is exposed during backward: communication is slower than compute here; "
        "compress='bf16' halves the bytes, a faster link or fewer ranks per link help"
    )
    return Check("overlap", WARN, value, f"{share:.0%} of the step waits on comm; {where}", details)


def check_scaling(throughputs: Mapping[int, float], *, unit: str = "samples") -> Check:
    """Check 8: throughput at 1..N ranks and the efficiency ``T(N) / (N x T(1))``.

    Fails when N ranks are slower than one (efficiency below ``1 / N``), warns below
    ``SCALING_PASS``.

    Args:
        throughputs (Mapping[int, float]): items/s of the whole job per rank count.
        unit (str): what an item is.
    """
    if len(throughputs) < 2:
        return not_applicable(
            "scaling", "one rank", "run with --nproc 2 or more (or under torchrun) to compare"
        )
    eff = efficiencies(throughputs)
    n = max(throughputs)
    value = ", ".join(
        f"{k} rank(s) {throughputs[k]:.4g} {unit}/s ({eff[k]:.0%})" for k in sorted(throughputs)
    )
    details = {
        "throughput": {str(k): v for k, v in sorted(throughputs.items())},
        "efficiency": {str(k): v for k, v in eff.items()},
        "unit": unit,
    }
    if eff[n] >= SCALING_PASS:
        return Check("scaling", PASS, value, f"{eff[n]:.0%} at {n} ranks", details)
    if eff[n] * n < 1:
        return Check(
            "scaling",
            FAIL,
            value,
            f"{n} ranks are slower than one ({eff[n]:.0%}): communication (or ranks sharing "
            "cores/GPUs) costs more than the extra ranks give; see the overlap and bandwidth "
            "checks",
            details,
        )
    return Check(
        "scaling",
        WARN,
        value,
        f"{eff[n]:.0%} at {n} ranks: look at exposed communication (overlap check) and the "
        "link bandwidth; larger per-rank batches amortise communication",
        details,
    )
