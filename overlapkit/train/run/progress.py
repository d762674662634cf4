"""What rank 0 shows and records while training: progress bar, TensorBoard scalars, summary.

The progress bar shows the loss (rank 0's micro-batches: reading the others' would add a
collective to every step), the throughput of the whole job, and the exposed communication: with
the ``live`` monitor, rank 0's median over its recent steps (a window's: ``exposed_comm=7.0ms
(live: recent steps)``); without it, once the profiler has saved a cycle, the median of that
cycle's steps, labelled with them (``(median of steps 4-6)``): the steps after the profiled
window are not measured, so a bare figure beside each of them would pass for theirs.
TensorBoard gets one point per step under ``train/`` and ``perf/``, and, every live window,
``live/`` (per step: the ranks' mean exposed ms, each rank's wait, the named ranks' cost);
``ok.profile`` writes its ``overlap/`` scalars itself.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

if TYPE_CHECKING:
    from overlapkit.live.monitor import LiveWindow

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunSummary:
    """The end-of-run numbers; ``summary.json`` in the run directory holds the same keys."""

    name: str
    world_size: int
    nodes: int | None
    parallel: str
    unit: str
    """What throughput counts: ``tok`` (tokens) or ``samples``."""
    start_step: int
    final_step: int
    steps_run: int
    seconds: float
    """Wall time of the steps run, s."""
    steps_per_s: float | None
    """Over the steps after the first (the first pays for warm-up), steps/s."""
    items_per_s: float | None
    """Tokens (or samples) per second of the whole job, over the same steps."""
    median_step_ms: float | None
    loss_first: float | None
    loss_last: float | None
    exposed_comm_share: float | None = None
    """Exposed comm / step time, summed over the profiled steps of every rank; None unprofiled."""
    profiled_steps: int = 0
    run_dir: str = ""
    tensorboard_dir: str = ""
    profile_dir: str | None = None
    checkpoint: str | None = None
    mesh: dict | None = None
    """The planner's sizes and groups of every axis larger than 1; None without a topology."""
    pipeline: dict | None = None
    """With ``parallel.plan.pp > 1``: ``schedule``, ``pp``, ``virtual_stages``,
    ``micro_batches``, ``planned_bubble_share`` (the planner's idle share of a step,
    ``(p - 1) / (v m + p - 1)``, or a split backward's at F = I = W; None where not priced),
    ``planned_bubble_basis`` (which of the two) and, when profiled,
    ``send_recv_exposed_share`` (exposed send/recv / step time over the profiled rank-steps: the
    stages' waits for each other, the bubble, plus the transfers)."""
    ep_dispatch: list[dict] | None = None
    """Per rank, per MoE layer: the ``ep`` group its all-to-alls ran over and how many ran."""
    baseline_items_per_s: float | None = None
    """``train.baseline_items_per_s``: a 1-rank run's throughput, tok/s (or samples/s)."""
    scaling_efficiency: float | None = None
    """``items_per_s / (world_size x baseline_items_per_s)``; None without a baseline."""
    planned_layout: dict | None = None
    """The run's layout as the auto-planner describes it (``overlapkit plan --auto --json``'s
    layout keys and ``text``); None where the topology has no accelerator section."""
    predicted_step_s: float | None = None
    """The planner's step time for ``planned_layout``, s."""
    measured_step_s: float | None = None
    """The measured step beside it: the median over the steps after the first, the same steps
    as ``median_step_ms``, s."""
    live: dict | None = None
    """The ``live`` monitor's record: ``every``, ``gather_ms_per_step`` (rank 0's time in the
    monitor's gathers per step), ``noise_ms``, ``threshold_ms`` and
    ``per_rank`` totals (``steps``, ``wall_ms``, ``data_ms``, ``busy_ms``, ``wait_ms``,
    ``gap_ms``, ``exposed_ms_per_step``); None with ``~live``."""
    stragglers: list[dict] | None = None
    """The ranks the live monitor named during the run, costliest first: ``rank``,
    ``collective``, ``cause``, ``cost_ms`` (per step), ``step`` (onset), ``named_at``,
    ``last_step`` (None: still slow at the end), ``steps``, ``total_cost_ms``, ``excess_ms``;
    None with ``~live``."""

    def format(self) -> str:
        """Readable lines for the end of the run."""
        where = f"{self.world_size} rank{'s' * (self.world_size != 1)}"
        if self.nodes:
            where += f" on {self.nodes} node{'s' * (self.nodes != 1)}"
        lines = [f"overlapkit-train {self.name}: {self.parallel}, {where}"]
        if self.steps_run == 0:
            lines.append(f"  nothing to do: already at step {self.final_step}")
        else:
            lines.append(
                f"  steps {self.start_step + 1}..{self.final_step} in {self.seconds:.1f} s"
                + (f", resumed from step {self.start_step}" if self.start_step else "")
            )
        if self.steps_per_s is not None:
            lines.append(
                f"  {self.steps_per_s:.2f} steps/s, {self.items_per_s:,.0f} {self.unit}/s, "
                f"median step {self.median_step_ms:.1f} ms"
            )
        if self.scaling_efficiency is not None:
            lines.append(
                f"  scaling efficiency {100 * self.scaling_efficiency:.1f}% = "
                f"{self.items_per_s:,.0f} / ({self.world_size} x "
                f"{self.baseline_items_per_s:,.0f}) {self.unit}/s vs the 1-rank baseline"
            )
        if self.loss_first is not None:
            lines.append(f"  loss {self.loss_first:.4f} -> {self.loss_last:.4f}")
        if self.exposed_comm_share is not None:
            lines.append(
                f"  exposed comm: {100 * self.exposed_comm_share:.1f}% of step time over "
                f"{self.profiled_steps} profiled rank-steps (details: overlapkit report "
                f"{self.profile_dir})"
            )
        if self.live is not None:
            lines.append(_live_line(self.live, self.stragglers or []))
        if self.pipeline is not None:
            pipeline = self.pipeline
            stages = pipeline["pp"] * pipeline["virtual_stages"]
            planned = pipeline["planned_bubble_share"]
            basis = pipeline.get("planned_bubble_basis", "(p-1)/(v m + p-1)")
            line = (
                f"  pipeline {pipeline['schedule']}: {stages} stages, "
                f"{pipeline['micro_batches']} micro-batches; planned bubble {basis} = "
                + ("not priced" if planned is None else f"{100 * planned:.1f}% of the step")
            )
            exposed = pipeline.get("send_recv_exposed_share")
            if exposed is not None:
                line += (
                    f"; measured: send/recv exposed {100 * exposed:.1f}% "
                    "of step time (bubble + transfers)"
                )
            lines.append(line)
        if self.checkpoint:
            lines.append(f"  checkpoint: {self.checkpoint}")
        lines.append(f"  TensorBoard: tensorboard --logdir {self.tensorboard_dir}")
        if self.predicted_step_s is not None:
            line = f"  planned {self.planned_layout['text']}: predicted step "
            line += f"{self.predicted_step_s * 1e3:.1f} ms"
            if self.measured_step_s is not None:
                line += (
                    f", measured {self.measured_step_s * 1e3:.1f} ms (median step; measured / "
                    f"predicted {self.measured_step_s / self.predicted_step_s:.2f})"
                )
            lines.append(line)
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


def _live_line(live: dict, stragglers: list[dict]) -> str:
    exposed = [r["exposed_ms_per_step"] for r in live["per_rank"] if r["steps"]]
    line = "  live: exposed comm "
    line += f"{statistics.mean(exposed):.1f} ms/step (mean of ranks)" if exposed else "not measured"
    if not stragglers:
        return line + "; no straggler named"
    worst = stragglers[0]
    return line + (
        f"; stragglers: {len(stragglers)}, costliest rank {worst['rank']} ({worst['cause']}, the "
        f"others waiting in {worst['collective']}) {worst['cost_ms']:.1f} ms/step from step "
        f"{worst['step']}"
    )


def scaling_efficiency(
    items_per_s: float | None, world_size: int, baseline_items_per_s: float | None
) -> float | None:
    """``T(N) / (N x T(1))``: this run's throughput over ``world_size`` times a 1-rank run's.

    Args:
        items_per_s (float | None): this run's tokens (or samples) per second, whole job.
        world_size (int): N, the ranks of this run.
        baseline_items_per_s (float | None): T(1), the same config on 1 rank, same unit.

    Returns:
        float | None: 1.0 is linear scaling; None when either throughput is unknown.
    """
    if items_per_s is None or baseline_items_per_s is None:
        return None
    if world_size < 1 or not baseline_items_per_s > 0:
        raise ValueError(
            f"scaling efficiency needs world_size >= 1 and a baseline > 0, got {world_size} and "
            f"{baseline_items_per_s!r}"
        )
    return items_per_s / (world_size * baseline_items_per_s)


class Monitor:
    """Rank 0's progress bar and TensorBoard writer; on other ranks every method does nothing.

    Args:
        enabled (bool): True on rank 0.
        tb_dir (Path): where the TensorBoard event file goes.
        start_step (int): the last step already done (0 for a fresh run).
        end_step (int): the last step this run will do.
        items_per_step (int): tokens (or samples) per optimizer step, whole job.
        unit (str): ``tok`` or ``samples``.
        progress (bool): show the tqdm bar.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        tb_dir: Path,
        start_step: int,
        end_step: int,
        items_per_step: int,
        unit: str,
        progress: bool,
    ):
        self.enabled = enabled
        self.items_per_step = items_per_step
        self.unit = unit
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.exposed_comm: str | None = None
        self._live_exposed: str | None = None
        self._writer = SummaryWriter(str(tb_dir)) if enabled else None
        self._bar = (
            tqdm(total=end_step, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
            if enabled and progress
            else None
        )
        # Log lines (the profiler's "wrote <trace>") are printed above the bar, not into its line.
        self._logs_above_bar = logging_redirect_tqdm() if self._bar is not None else None
        if self._logs_above_bar is not None:
            self._logs_above_bar.__enter__()

    def step(
        self, step: int, *, loss: float, lr: float, grad_norm: float | None, step_s: float
    ) -> None:
        """Record one optimizer step (its loss, learning rate, gradient norm, wall time in s)."""
        if not self.enabled:
            return
        self.step_s.append(step_s)
        self.losses.append(loss)
        items_per_s = self.items_per_step / step_s
        writer = self._writer
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/lr", lr, step)
        if grad_norm is not None:
            writer.add_scalar("train/grad_norm", grad_norm, step)
        writer.add_scalar("perf/step_ms", 1e3 * step_s, step)
        writer.add_scalar(f"perf/{self.unit}_per_s", items_per_s, step)
        if self._bar is not None:
            postfix = {"loss": f"{loss:.4f}", f"{self.unit}/s": f"{items_per_s:,.0f}"}
            exposed = self._live_exposed or self.exposed_comm
            if exposed is not None:
                postfix["exposed_comm"] = exposed
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def live_step(self, window: LiveWindow | None, *, exposed_ms: float | None) -> None:
        """The live monitor's view after a step: rank 0's recent exposed comm (ms, for the bar)
        and, after a gather, the window's ``live/`` scalars."""
        if not self.enabled:
            return
        if exposed_ms is not None:
            self._live_exposed = f"{exposed_ms:.1f}ms (live: recent steps)"
        if window is None:
            return
        cost = sum(s.cost_ms for s in window.named.values())
        for k, step in enumerate(window.steps.tolist()):
            waits = window.wait_ms[:, k]
            self._writer.add_scalar("live/exposed_ms", float(waits.mean()), step)
            for rank, wait in enumerate(waits.tolist()):
                self._writer.add_scalar(f"live/wait_ms/rank{rank}", wait, step)
            self._writer.add_scalar("live/straggler_cost_ms", cost, step)

    def set_exposed_comm(self, exposed_ms: float, steps: range) -> None:
        """The median exposed comm (ms) of the profiled ``steps``, shown from now on as theirs."""
        self.exposed_comm = f"{exposed_ms:.1f}ms (median of steps {steps.start}-{steps.stop - 1})"

    def close(self) -> None:
        if self._logs_above_bar is not None:
            self._logs_above_bar.__exit__(None, None, None)
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()

    def throughput(self) -> tuple[float | None, float | None, float | None]:
        """``(steps/s, items/s, median step ms)`` over the steps after the first."""
        steady = self.step_s[1:] or self.step_s
        if not steady:
            return None, None, None
        steps_per_s = len(steady) / sum(steady)
        return steps_per_s, steps_per_s * self.items_per_step, 1e3 * statistics.median(steady)
