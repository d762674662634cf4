"""``overlapkit-train``'s entry point: the workers' fork server starts before anything heavy.

The launcher imports Hydra, torch and the training loop's modules before it starts any worker,
and the fork server its local workers come from (``overlapkit.workers.forkserver``) imports
torch and the loop again: about 2 s of one core each. Started first, the server imports on
another core while this process does (a 2-rank run of gpt_tiny on 2 cores: ``bench.launch_start``),
so this module imports nothing heavy before ``start_server()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from overlapkit.train.launch.slurm import ranks_are_tasks
from overlapkit.workers.forkserver import start_server


def starts_local_workers(env: Mapping[str, str] | None = None) -> bool:
    """Whether this launch may start local workers: False inside a Slurm step whose tasks are
    each one rank (``slurm.ranks_are_tasks``; uneven steps are refused later), so that no idle
    server is kept for a whole run; True otherwise."""
    env = os.environ if env is None else env
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_STEP_NUM_NODES", "")
    return not (tasks.isdigit() and nodes.isdigit() and ranks_are_tasks(int(tasks), int(nodes)))


def main() -> None:
    """Console entry point: ``overlapkit-train [overrides] [-m]``."""
    if starts_local_workers():
        start_server()
    # Imported after the server has started, so that both import at once.
    from overlapkit.train.launch.cli import main as run_launcher

    run_launcher()


if __name__ == "__main__":
    main()
