"""bench.planner_ranking's layouts: each composed from overlapkit-train's own groups and priced
as the layout a run of that config prices itself with (``overlapkit.train.planning.planned``)."""

import copy

import pytest

from bench.planner_ranking import LAYOUTS, parse_args, planned_layout, run_config
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.train.parallel.mesh import split_parallel

# The layouts issue 30 added (each composition costs about a second): the planner's fields
# that differ from ddp over dp = 4, and the wrapper.
ADDED = {
    "pp2": ({"pp": 2, "dp": 2}, "overlapkit.ddp"),
    "cp2": ({"cp": 2, "dp": 2}, "overlapkit.ddp"),
    "zero1": ({"sharding": "zero1"}, "overlapkit.fsdp"),
    "zero2": ({"sharding": "zero2"}, "overlapkit.fsdp"),
    "full": ({"recompute": "full"}, "overlapkit.ddp"),
    "selective": ({"recompute": "selective"}, "overlapkit.ddp"),
}


def test_each_added_layout_is_priced_as_the_run_its_config_describes_and_overlapkit_train_runs_it():
    assert set(LAYOUTS["gpt_tiny"]) == {"ddp", "fsdp", "hsdp", "tp2", *ADDED}
    args = parse_args(["--batch", "4", "--micro-batches", "3"])
    configs = {name: run_config("gpt_tiny", name, args) for name in ADDED}
    base = dict(tp=1, pp=1, cp=1, ep=1, dp=4, micro_batch=4, num_micro_batches=3)
    base |= dict(sharding="ddp", recompute="none")
    for name, (fields, target) in ADDED.items():
        layout = planned_layout(configs[name], 4)
        assert {k: getattr(layout, k) for k in base} == base | fields, name
        assert OVERLAPKIT_TRAIN.refusal(layout, layers=4) is None, name
        assert configs[name].train.clip_grad_norm is None  # the planner does not price clipping
        _, factory = split_parallel(configs[name].parallel)
        assert factory["_target_"] == target, name
        if target == "overlapkit.ddp":
            assert factory["bucket_mb"] == 25, name  # one bucket, as the planner's rule gives
    # A control: a wrapper the planner has no sharding for is refused by name.
    foreign = copy.deepcopy(configs["full"])
    foreign.parallel._target_ = "torch.nn.Identity"
    with pytest.raises(ValueError, match="no layout"):
        planned_layout(foreign, 4)
