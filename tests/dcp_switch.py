"""Save a run with DCP mid-training and go on in another form from what was saved.

A run is anything with ``model``, ``opt`` (its optimizer), ``sched`` (its LR scheduler) and
``bucketer`` attributes; the per-bucket tests switch between the synchronous and the overlap form
of ``ok.GradBucketer`` this way, in both directions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

Run = TypeVar("Run")


def switch_through_dcp(run: Run, make_next: Callable[[], Run], path: str) -> Run:
    """``dcp.save`` the model and optimizer of ``run`` to ``path``; a new run loaded from it."""
    model_sd, optim_sd = get_state_dict(run.model, run.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    sched_sd = run.sched.state_dict()
    run.bucketer.remove()
    new = make_next()
    model_sd, optim_sd = get_state_dict(new.model, new.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        new.model, new.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    new.sched.load_state_dict(sched_sd)
    return new
