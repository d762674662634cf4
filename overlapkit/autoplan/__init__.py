"""The auto-planner: which layout to train a model with on a topology.

A model description (``model_spec``, ``models``), its memory (``memory``) and step time
(``step_time``, ``gemm``, ``compute``) per layout as a framework runs it (``framework``: which
layouts it runs, how it splits them; ``selective``: what its selective recomputation costs), the
search over every layout (``search``; the layouts a request allows: ``layout_space``;
``settings``, ``candidate``, priced per group shape by ``group_costs``; how the user's pins are
spelled: ``pins``), ``ok.plan(..., auto=True)`` (``ok_plan``), its check against published
training runs (``published_runs``) and the hand-off of the winner (``handoff``). A layout itself
is ``overlapkit.layout``'s. It sits above placement (``overlapkit.planner``) and the cost model
(``overlapkit.cost``).
"""

from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.ok_plan import AutoPlan, auto_plan, plan
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings

__all__ = [
    "AutoPlan",
    "ModelSpec",
    "PlanSearchError",
    "SearchSettings",
    "auto_plan",
    "load_model",
    "plan",
]
