"""``check_finite``: NaN/Inf gradients after reduction, raised or skipped on every rank together.

Why every rank reaches the same verdict without an extra collective: the check runs on the
*reduced* bucket, which is the same on every rank.

- A NaN or Inf in any rank's input stays non-finite in the sum whatever the summation order
  (NaN + x = NaN; +Inf + finite = +Inf; +Inf + -Inf = NaN), so it is seen everywhere.
- A sum of finite values that overflows to Inf depends on the summation order, but gloo and NCCL
  compute each element's sum once (ring or tree reduce) and copy it to every rank, so every rank
  holds the same bits. ``tests/test_check_finite.py`` checks the verdict on both ranks with a
  NaN injected on one.

``on_nonfinite="raise"`` raises ``NonFiniteGradients`` on every rank, naming the parameters with
NaN/Inf and every parameter of their bucket. ``on_nonfinite="skip"`` drops the step: every
trainable parameter's ``.grad`` is set to None on every rank, so ``optimizer.step()`` leaves every
parameter (and its optimizer state: momentum, weight decay) unchanged, and the step index is
recorded in ``ok.comm_stats(model).skipped_steps`` (0-based, counted like ``comm_stats`` records).

Disabled (the default) nothing of this runs: ``ok.ddp`` registers the same hook as without the
option, and ``GradBucketer.wait()`` tests one attribute for None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from overlapkit.ddp.comm_stats import CommRecorder

logger = logging.getLogger(__name__)

ON_NONFINITE = ("raise", "skip")
Hook = Callable[[object, dist.GradBucket], torch.futures.Future]


class NonFiniteGradients(RuntimeError):
    """Gradients held NaN or Inf after reduction (raised on every rank of the group).

    Attributes:
        step (int): the wrapper's step (0-based).
        parameters (tuple[str, ...]): names of the parameters with NaN/Inf.
        buckets (tuple[str, ...]): the buckets they were in, e.g. ``"bucket 1"``.
    """

    def __init__(self, message: str, *, step: int, parameters: tuple[str, ...], buckets: tuple):
        super().__init__(message)
        self.step = step
        self.parameters = parameters
        self.buckets = buckets


def validate_finite_options(
    check_finite: bool, on_nonfinite: str, *, caller: str
) -> tuple[bool, str]:
    """Check ``check_finite`` (a bool) and ``on_nonfinite`` (``"raise"`` or ``"skip"``).

    Raises:
        TypeError: ``check_finite`` is not a bool.
        ValueError: unknown ``on_nonfinite``, or ``"skip"`` without ``check_finite=True``.
    """
    if not isinstance(check_finite, bool):
        raise TypeError(f"{caller}: check_finite must be a bool, got {check_finite!r}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"{caller}: unknown on_nonfinite={on_nonfinite!r}; choose one of {list(ON_NONFINITE)}"
        )
    if on_nonfinite == "skip" and not check_finite:
        raise ValueError(
            f"{caller}: on_nonfinite='skip' needs check_finite=True (nothing is checked without it)"
        )
    return check_finite, on_nonfinite


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding NaN or Inf."""
    return [name for name, t in named if not bool(torch.isfinite(t).all())]


def nonfinite_message(caller: str, step: int, found: Sequence[tuple[str, list, list]]) -> str:
    """Message for ``found``: (bucket, names with NaN/Inf, every name in the bucket) triples."""
    parts = [f"{where}: {bad} (the bucket holds {names})" for where, bad, names in found]
    return (
        f"{caller}: non-finite (NaN/Inf) gradients after the all-reduce in step {step}, the same "
        f"on every rank: " + "; ".join(parts) + ". Lower the learning rate, check the loss "
        "and inputs, or pass on_nonfinite='skip' to drop such steps"
    )


class FiniteCheck:
    """What ``check_finite`` found in the current step, and what to do about it.

    Args:
        caller (str): the wrapper, as the user spells it.
        on_nonfinite (str): ``"raise"`` or ``"skip"``.
        recorder (CommRecorder): the wrapper's recorder (step count, ``skipped_steps``).
        named_params (Sequence): the trainable ``(name, parameter)`` pairs; skipping drops
            all their gradients.
    """

    __slots__ = ("_armed_step", "_sums", "caller", "named_params", "on_nonfinite", "recorder")

    def __init__(
        self,
        caller: str,
        on_nonfinite: str,
        recorder: CommRecorder,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
    ):
        self.caller = caller
        self.on_nonfinite = on_nonfinite
        self.recorder = recorder
        self.named_params = list(named_params)
        self._sums: list[tuple[str, torch.Tensor, Callable]] = []
        self._armed_step: int | None = None

    def inspect(
        self,
        where: str,
        reduced: torch.Tensor,
        named: Callable[[], Sequence[tuple[str, torch.Tensor]]],
    ) -> None:
        """Note a reduced bucket, to be judged at ``finish_step`` (no device sync here).

        Args:
            where (str): the bucket, e.g. ``"bucket 1"``.
            reduced (Tensor): the whole reduced bucket. A bucket costs one sum, kept on its
                device: a finite sum proves every element finite (NaN or Inf in any element
                makes the sum NaN or Inf), and is ~10x faster than ``isfinite(t).all()`` on CPU.
                A non-finite sum (a NaN/Inf, or a finite overflow) is confirmed element-wise.
            named (Callable): returns the bucket's ``(name, gradient view)`` pairs; only
                called when the sum is not finite.
        """
        self._sums.append((where, torch.sum(reduced, dtype=torch.float32), named))

    def finish_step(self, step: int) -> bool:
        """Raise or skip if anything was found in ``step``; reset for the next step.

        Returns:
            bool: whether the step was skipped (every gradient dropped).

        Raises:
            NonFiniteGradients: with ``on_nonfinite="raise"``.
        """
        sums, self._sums = self._sums, []
        if not sums:
            return False
        # One host read per step, however many buckets: all sums finite is the healthy case.
        if bool(torch.isfinite(torch.stack([total for _, total, _ in sums])).all()):
            return False
        found = []
        for where, total, named in sums:
            if bool(torch.isfinite(total)):
                continue
            pairs = named()
            bad = nonfinite_names(pairs)
            if bad:
                found.append((where, bad, [n for n, _ in pairs]))
        if not found:
            return False
        if self.on_nonfinite == "raise":
            raise NonFiniteGradients(
                nonfinite_message(self.caller, step, found),
                step=step,
                parameters=tuple(n for _, bad, _ in found for n in bad),
                buckets=tuple(where for where, _, _ in found),
            )
        for _, p in self.named_params:
            p.grad = None
        self.recorder.skipped_steps.append(step)
        logger.warning(
            "%s: skipped step %d (gradients dropped on every rank): non-finite gradients in %s",
            self.caller,
            step,
            "; ".join(f"{where} {bad}" for where, bad, _ in found),
        )
        return True

    def arm_ddp_step(self, step: int) -> None:
        """From a DDP comm hook: decide once DDP has written this step's gradients.

        DDP queues its own end-of-backward callback (which waits for every bucket and writes
        ``.grad``) when the last bucket is ready, after this hook's first call; a callback
        queued from a final callback runs after all of them, so it sees the written gradients.
        """
        if self._armed_step == step:
            return
        self._armed_step = step
        # What an aborted step found (a failed all-reduce raised first) is not this step's.
        self._sums = []
        engine = Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: self.finish_step(step)))


def check_finite_wrapper(hook: Hook, check: FiniteCheck) -> Hook:
    """Wrap a DDP comm hook so that each reduced bucket is checked for NaN/Inf.

    The result is checked after ``hook``'s future completes; the verdict is acted on at the
    end of backward (``FiniteCheck.arm_ddp_step``), on every rank alike.

    Example::
        >>> check = FiniteCheck("ok.ddp", "skip", recorder, model.named_parameters())
        >>> ddp_model.register_comm_hook(state, check_finite_wrapper(allreduce_hook, check))
    """
    names = {id(p): n for n, p in check.named_params}

    def check_finite_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        step = check.recorder.step  # read before the hook: the last bucket ends the step
        check.arm_ddp_step(step)
        where = f"bucket {bucket.index()}"
        params = bucket.parameters()

        def inspect(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()

            def views() -> list[tuple[str, torch.Tensor]]:
                # The bucket is the parameters' gradients back to back, in this order.
                out, offset = [], 0
                for p in params:
                    out.append((names[id(p)], reduced[offset : offset + p.numel()]))
                    offset += p.numel()
                return out

            check.inspect(where, reduced, views)
            return reduced

        return hook(state, bucket).then(inspect)

    # DDP reads the annotations at registration (see ``overlapkit.ddp.hooks``).
    check_finite_hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return check_finite_hook
