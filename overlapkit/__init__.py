"""overlapkit: hide distributed-training communication behind compute, and measure what is left.

The public surface (docs/index.md; the layers below it: docs/architecture.md)::

    import overlapkit as ok
    model = ok.ddp(model, bucket_mb=25, compress=None)
    bucketer = ok.GradBucketer(model, bucket_mb=25)
    ok.comm_stats(model)
    live = ok.LiveMonitor()   # every step's exposed comm, live stragglers

Every name is imported on first use (PEP 562 module ``__getattr__``), so ``import overlapkit``
costs milliseconds and ``overlapkit topo`` never loads DTensor, FSDP or the profiler. Two names
are also sub-packages (``ok.ddp`` and ``ok.fsdp``): when Python imports the sub-package
``overlapkit.ddp`` it would bind the attribute ``overlapkit.ddp`` to the module; the module
class below keeps the function there instead, as the eager ``from ... import ddp`` used to.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Public name -> the module that defines it (not a package that re-exports it: a package
# attribute can be shadowed by a same-named sub-module, as overlapkit.ddp.comm_stats is).
_EXPORTS: dict[str, str] = {
    "ConfigMismatch": "overlapkit.group.consistency",
    "BucketCommRecord": "overlapkit.ddp.comm_stats",
    "CommStats": "overlapkit.ddp.comm_stats",
    "GradBucketer": "overlapkit.ddp.bucketer",
    "comm_stats": "overlapkit.ddp.comm_stats",
    "ddp": "overlapkit.ddp.wrap",
    "CollectiveFailure": "overlapkit.group.failures",
    "StallError": "overlapkit.group.stall_watchdog",
    "StallWatchdog": "overlapkit.group.stall_watchdog",
    "enable_flight_recorder": "overlapkit.group.stall_watchdog",
    "NonFiniteGradients": "overlapkit.ddp.finite",
    "fsdp": "overlapkit.fsdp.wrap",
    "fsdp_stats": "overlapkit.fsdp.state",
    "SequenceParallel": "overlapkit.inlayer.sequence_parallel",
    "sequence_parallel": "overlapkit.inlayer.sequence_parallel",
    "dispatch_combine": "overlapkit.inlayer.chunked_ep",
    "DispatchStats": "overlapkit.inlayer.chunked_ep",
    "comm_dim": "overlapkit.group.dim_labels",
    "LiveConfig": "overlapkit.live.monitor",
    "LiveMonitor": "overlapkit.live.monitor",
    "Estimate": "overlapkit.cost.estimate",
    "Placement": "overlapkit.planner.placement",
    "estimate": "overlapkit.cost.estimate",
    "plan": "overlapkit.autoplan.ok_plan",
    "profile": "overlapkit.profiling.profiler",
    "Topology": "overlapkit.topology",
    "detect_topology": "overlapkit.topology",
    "load_topology": "overlapkit.topology",
    "Trial": "overlapkit.tuning",
    "TuningReport": "overlapkit.tuning",
    "tuning_report": "overlapkit.tuning",
}

# In a leaf of its own, so that modules inside the package read it without importing this one.
_EXPORTS["__version__"] = "overlapkit._version"

__all__ = sorted(_EXPORTS)


class _PublicAPI(types.ModuleType):
    """The ``overlapkit`` module: public names load on first access and are then cached."""

    def __getattr__(self, name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'overlapkit' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # The import system binds a sub-package that shares a public name (overlapkit.ddp,
        # overlapkit.fsdp) here; the public function keeps the name.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_EXPORTS})


sys.modules[__name__].__class__ = _PublicAPI
