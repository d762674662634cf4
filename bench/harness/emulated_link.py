"""Put a benchmark behind an emulated scale-out link (see docs/emulation.md).

``enter_emulated_link(rate, delay_ms)`` re-executes the current command (``python -m
bench.<name> ...``, as it was started) inside a private network namespace (``unshare -n``) whose
loopback is limited by ``tc``: every rank of the benchmark then talks over a link of ``rate``
with ``delay_ms`` one-way delay, as ranks on different nodes would. The namespace disappears
with the process, so nothing is left behind even on a crash.

When ``unshare`` or ``tc`` is unavailable (not root, no iproute2) it says so and returns, and the
benchmark runs on plain loopback.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

_INSIDE = "OVERLAPKIT_EMULATED_LINK"


def current_link() -> dict[str, str] | None:
    """``{"rate", "delay"}`` of the link this process runs behind, or None for plain loopback."""
    value = os.environ.get(_INSIDE)
    if not value:
        return None
    rate, delay = value.split(",")
    return {"rate": rate, "delay": delay}


def _tc_commands(rate: str, delay_ms: float) -> list[str]:
    # tbf limits the rate; netem (as the parent qdisc) adds the delay when one is asked for.
    tbf = f"tbf rate {rate} burst 256kb latency 100ms"
    if delay_ms > 0:
        return [
            f"tc qdisc add dev lo root handle 1: netem delay {delay_ms}ms limit 100000",
            f"tc qdisc add dev lo parent 1: handle 2: {tbf}",
        ]
    return [f"tc qdisc add dev lo root {tbf}"]


def _probe(commands: list[str]) -> str | None:
    """None when ``commands`` succeed in a throw-away namespace, else why they failed."""
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", " && ".join(["ip link set lo up", *commands])],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"exit {probe.returncode}")


def _can_emulate() -> str | None:
    """None when ``unshare -n`` and ``tc`` work here, else the reason they do not."""
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    failure = _probe(_tc_commands("1gbit", 0))
    return None if failure is None else f"unshare/tc failed ({failure}); needs root"


def enter_emulated_link(rate: str, delay_ms: float = 0.0) -> None:
    """Re-run this command behind an emulated link, unless already behind one or impossible.

    Args:
        rate (str): tc rate, e.g. ``"8gbit"``; ``"none"`` keeps plain loopback.
        delay_ms (float): one-way delay added to every packet, in ms. Defaults to 0.

    Does not return when it re-executes (the new process replaces this one).
    """
    if rate == "none" or current_link() is not None:
        return
    reason = _can_emulate()
    if reason is not None:
        print(f"[emulated link] unavailable: {reason}; running on plain loopback", flush=True)
        return
    if delay_ms > 0 and _probe(_tc_commands(rate, delay_ms)) is not None:
        # Kernels without sch_netem cannot add delay; the rate limit still applies.
        print("[emulated link] netem is unavailable here: delay ignored, rate kept", flush=True)
        delay_ms = 0.0
    script = " && ".join(["ip link set lo up", *_tc_commands(rate, delay_ms)])
    # The interpreter's own argv, so that ``-m bench.<name>`` (and any -X option) is kept.
    command = shlex.join([sys.executable, *sys.orig_argv[1:]])
    env = dict(os.environ, **{_INSIDE: f"{rate},{delay_ms}ms"})
    sys.stdout.flush()
    os.execvpe("unshare", ["unshare", "-n", "bash", "-c", f"{script} && exec {command}"], env)
