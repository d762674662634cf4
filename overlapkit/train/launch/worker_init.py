"""``launcher.worker_init``: functions every worker calls once, before it joins the process group.

Each entry names a function as ``module:function`` (``my_site.hooks:pin_numa``), which the worker
imports and calls with a ``WorkerContext`` after its logging is set up and before
``init_process_group`` and training. Uses: site set-up that must happen in the worker process
(NUMA or core pinning, an environment variable a library reads on import, a custom signal
handler), and the test suite's fault injection (``tests/faults.py``: a worker killed mid-step, a
damaged checkpoint, a slowed rank), which therefore ships in no install. The module must be
importable by the workers (installed, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

WorkerInit = Callable[["WorkerContext"], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerContext:
    """What a ``launcher.worker_init`` function is told about the worker calling it."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    world_size: int
    """Ranks in the job."""
    attempt: int
    """torch elastic's restart count: 0 on the first attempt, 1 after the first restart, ..."""
    run_dir: Path
    """The run directory (node 0's Hydra output directory; checkpoints in ``checkpoints/``)."""


def resolve_worker_init(spec: str) -> WorkerInit:
    """The function ``spec`` (``module:function``) names.

    Raises:
        ValueError: ``spec`` is not ``module:function``, the module cannot be imported, or it
            has no such callable; the message names ``launcher.worker_init`` and the value.
    """
    module_name, colon, function_name = str(spec).partition(":")
    where = f"launcher.worker_init entry {spec!r}"
    if not (colon and module_name and function_name.isidentifier()):
        raise ValueError(f"{where} must be 'module:function' (e.g. 'my_site.hooks:pin_numa')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{where}: cannot import {module_name!r} ({err}); install it or put it on PYTHONPATH"
        ) from err
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{where}: {module_name} has no function {function_name!r}")
    return function


def run_worker_init(specs: Sequence[str], context: WorkerContext) -> None:
    """Call each function ``specs`` names with ``context``, in order."""
    for spec in specs:
        resolve_worker_init(spec)(context)
