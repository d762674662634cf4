"""Which checkpoint a run resumes from: the newest one that every rank can load.

A committed checkpoint (``overlapkit.train.run.checkpoint``) is complete, but it can still be
unusable: a ``.metadata`` or a value holding a pickled callable (refused, so nothing in it runs),
a truncated or corrupted file, the RNG state of another kind of run. Such a refusal used to end
every worker with a traceback; torch elastic restarted them into the same refusal until
``launcher.max_restarts`` ran out, and the run stopped.

``resume_from_newest_usable`` tries the committed checkpoints newest first, every rank the same
one (rank 0 lists them). A refused checkpoint costs one ERROR line per rank (each rank's own
reason, so every rank's log says it) and the ranks go on, together, to the previous one; once
one loads on every rank, rank 0 warns naming it and the newer ones it passed over. When none
can be used, ``NoUsableCheckpoint`` says so in one line naming each and why; the workers return
it instead of failing (a restart would only meet it again) and ``overlapkit-train`` prints it as
its one error line (``overlapkit.train.launch.elastic``, ``overlapkit.train.launch.cli``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from overlapkit.train.run.checkpoint import CheckpointRefused, TrainingState

logger = logging.getLogger(__name__)


class NoUsableCheckpoint(ValueError):
    """Every committed checkpoint of the run was refused; the message names each and why."""


def resume_from_newest_usable(
    state: TrainingState, checkpoints: list[tuple[int, Path]]
) -> tuple[int, Path] | None:
    """Load the newest of ``checkpoints`` that every rank can use; a collective of all ranks.

    Args:
        state (TrainingState): the live objects to load into.
        checkpoints (list[tuple[int, Path]]): the committed checkpoints as ``(step, path)``,
            oldest first (``committed_checkpoints``), the same list on every rank.

    Returns:
        tuple[int, Path] | None: the step loaded and its checkpoint; None when there is none.

    Raises:
        NoUsableCheckpoint: there are checkpoints and every one was refused (on every rank).
    """
    refused: list[CheckpointRefused] = []
    for _, path in reversed(checkpoints):
        try:
            step = state.load(path)
        except CheckpointRefused as error:
            logger.error("checkpoint refused: %s", error.line_for(state.rank))
            refused.append(error)
            continue
        if refused:
            logger.warning(
                "resuming from %s, the newest checkpoint every rank can use, instead of the "
                "newer %s (refused, see above)",
                path,
                ", ".join(str(e.path) for e in refused),
            )
        return step, path
    if refused:
        raise NoUsableCheckpoint(
            f"no usable checkpoint to resume from in {refused[0].path.parent}: "
            + "; ".join(str(e) for e in refused)
            + ". Move them away (or repair them), or start another run (name=...)"
        )
    return None
