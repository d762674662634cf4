"""A failed ``ok.fsdp`` step: no gradient left for ``optimizer.step()``, FSDP2 reset for a retry.

When a rank dies or stalls in the middle of backward, a survivor's collective fails part-way
through the step, and its sharded gradients are then a mix: the blocks whose reduce-scatter (and
HSDP all-reduce across replicas) finished hold averaged gradients, the block whose collective
failed holds nothing or, when overlapkit's asynchronous reduce-scatter was in flight, a view of
an output buffer the collective never filled, and the earlier blocks hold nothing. A caller that
catches the ``CollectiveFailure`` and steps (a retry loop, a framework's error handler) would
update some blocks and not others, some of them from garbage. So before the failure is raised
(``FailureScope(on_failure=...)``, on the thread that raises), every gradient of the model is
set to None, as ``ok.ddp`` and ``ok.GradBucketer`` do: torch optimizers skip a parameter without
a gradient, so parameters and optimizer state stay as they were before the step.

The aborted backward also leaves FSDP2's per-step state behind: modules stay in
``PRE_BACKWARD``, which FSDP2's next forward takes for activation-checkpoint recomputation, so it
registers no backward hooks, and the retried step reduces nothing and raises nothing (seen on
HSDP survivors: their retry "succeeded" without a gradient). So the model's next forward first
calls FSDP2's ``FSDPModule.reset_iter_state()`` (torch's recovery for "an exception aborted a
forward or backward mid-flight"), and the retry runs a real step: on a group that lost a rank,
it meets the next ``CollectiveFailure``. A torch whose FSDP2 lacks that method gets a clear error
at that forward instead of a step that silently does nothing.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn


class FailedStep:
    """Drops an ``ok.fsdp`` model's gradients when a collective fails, and resets FSDP2 after.

    Args:
        model (nn.Module): the root right after ``fully_shard``: its registered parameters
            are then the sharded ones, which the user's optimizer holds.
    """

    __slots__ = ("_model", "_sharded", "reset_pending")

    def __init__(self, model: nn.Module) -> None:
        self._sharded = list(model.parameters())
        self._model = weakref.ref(model)
        self.reset_pending = False
        """A step failed and FSDP2 has not been reset since."""

    def __call__(self) -> None:
        """A collective failed: set ``.grad`` to None everywhere, reset at the next forward.

        The sharded parameters' gradients, and those of the parameters registered now: an
        aborted backward can leave blocks unsharded, their unsharded parameters registered in
        place of the sharded ones, and a gradient left there would be reduce-scattered into the
        next step's. Idempotent.
        """
        model = self._model()
        registered = [] if model is None else list(model.parameters())
        for param in self._sharded + registered:
            param.grad = None
        self.reset_pending = True

    def reset_if_failed(self) -> None:
        """From the root's forward pre-hook: after a failed step, reset FSDP2's per-step state.

        ``reset_iter_state`` waits for the failed step's all-gathers; one that failed raises
        its ``CollectiveFailure`` again, and the reset is tried again at the next forward.

        Raises:
            RuntimeError: a step failed and this torch's FSDP2 cannot be reset.
        """
        model = self._model()
        if not self.reset_pending or model is None:
            return
        reset = getattr(model, "reset_iter_state", None)
        if reset is None:
            raise RuntimeError(
                "ok.fsdp: a collective of an earlier step failed (CollectiveFailure), and "
                f"FSDP2 in torch {torch.__version__} has no FSDPModule.reset_iter_state() "
                "(torch 2.13 added it) to recover its state after the aborted backward; a "
                "further step would reduce nothing: restart the workers (torch elastic does "
                "with launcher.max_restarts)"
            )
        reset()
        self.reset_pending = False
