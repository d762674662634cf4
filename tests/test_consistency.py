"""Ranks that wrap different models or pass different options get one clear error at wrap time,
naming the first difference and the ranks on each side, instead of a hang or wrong sums."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkit as ok
from overlapkit.group.consistency import (
    ABSENT,
    ConfigMismatch,
    describe,
    digest,
    first_difference,
    mismatch_message,
)
from tests.multiproc import run_on_ranks
from tests.reference import make_mlp


def _renamed_mlp():
    """``make_mlp()`` with the same layers and weights under other names."""
    layers = list(make_mlp())
    names = ["inp", "act0", "hidden", "act1", "out"]
    return nn.Sequential(OrderedDict(zip(names, layers, strict=True)))


def _with_extra_parameter():
    model = make_mlp()
    model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    return model


def _with_frozen_bias():
    model = make_mlp()
    model[0].bias.requires_grad_(False)
    return model


def _cases(rank):
    """name → a wrap call whose model or options depend on the rank (None: the same)."""
    one = rank == 1
    mlp = make_mlp
    return {
        "ddp_same": lambda: ok.ddp(mlp(), bucket_mb=1),
        "ddp_shape": lambda: ok.ddp(make_mlp(hidden=33 if one else 32), bucket_mb=1),
        "ddp_names": lambda: ok.ddp(_renamed_mlp() if one else mlp(), bucket_mb=1),
        "ddp_bucket_mb": lambda: ok.ddp(mlp(), bucket_mb=2 if one else 1),
        "ddp_compress": lambda: ok.ddp(mlp(), bucket_mb=1, compress="bf16" if one else None),
        "ddp_extra_parameter": lambda: ok.ddp(_with_extra_parameter() if one else mlp()),
        "ddp_requires_grad": lambda: ok.ddp(_with_frozen_bias() if one else mlp()),
        "ddp_auto": lambda: ok.ddp(mlp(), bucket_mb=4 if one else "auto"),
        "wrapper": lambda: ok.GradBucketer(mlp()) if one else ok.ddp(mlp()),
        "bucketer_same": lambda: ok.GradBucketer(mlp(), bucket_mb=1),
        "bucketer_bucket_mb": lambda: ok.GradBucketer(mlp(), bucket_mb=0.5 if one else 1),
        "bucketer_shape": lambda: ok.GradBucketer(make_mlp(layers=4 if one else 3)),
        "bucketer_extra_parameter": lambda: ok.GradBucketer(
            _with_extra_parameter() if one else mlp()
        ),
        "fsdp_same": lambda: ok.fsdp(mlp(), blocks=nn.Linear),
        "fsdp_prefetch": lambda: ok.fsdp(mlp(), blocks=nn.Linear, prefetch=2 if one else 1),
        "fsdp_shape": lambda: ok.fsdp(make_mlp(hidden=33 if one else 32), blocks=nn.Linear),
        "fsdp_mixed_precision": lambda: ok.fsdp(
            mlp(), blocks=nn.Linear, mixed_precision="bf16" if one else None
        ),
        "fsdp_names": lambda: ok.fsdp(_renamed_mlp() if one else mlp(), blocks=nn.Linear),
    }


class _CountCollectives:
    """Counts the Python-level all-gathers issued inside the block (the check's collectives)."""

    def __enter__(self):
        self.tensor_gathers = self.object_gathers = 0
        # overlapkit.group.process_group.all_gather_single looks the torch function up per call.
        self._tensor_name = (
            "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        )
        self._saved = getattr(dist, self._tensor_name), dist.all_gather_object

        def tensor_gather(*args, **kwargs):
            self.tensor_gathers += 1
            return self._saved[0](*args, **kwargs)

        def object_gather(*args, **kwargs):
            self.object_gathers += 1
            return self._saved[1](*args, **kwargs)

        setattr(dist, self._tensor_name, tensor_gather)
        dist.all_gather_object = object_gather
        return self

    def __exit__(self, *exc):
        setattr(dist, self._tensor_name, self._saved[0])
        dist.all_gather_object = self._saved[1]


def _wrap_every_case(rank, world_size):
    outcomes = {}
    for name, wrap in _cases(rank).items():
        with _CountCollectives() as count:
            try:
                wrap()
                outcome = {"error": None}
            except ConfigMismatch as error:
                outcome = {"error": str(error), "field": error.field, "values": error.values}
        outcome.update(tensor_gathers=count.tensor_gathers, object_gathers=count.object_gathers)
        outcomes[name] = outcome
    # Last: rank 1 fails its own argument check and never reaches the consistency check.
    try:
        ok.GradBucketer(make_mlp(), bucket_mb=-1 if rank == 1 else 1)
        outcomes["unreached"] = None
    except (ValueError, RuntimeError) as error:
        outcomes["unreached"] = f"{type(error).__name__}: {error}"
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return run_on_ranks(
        _wrap_every_case, 2, collective_timeout_s=10, env={"OVERLAPKIT_CHECKIN_GRACE_S": "2"}
    )


EXPECTED = {
    # case: (first differing field, {value: ranks})
    "ddp_shape": ("parameter 0 ('0.weight') shape", {"(32, 16)": [0], "(33, 16)": [1]}),
    "ddp_names": ("parameter 0 name", {"0.weight": [0], "inp.weight": [1]}),
    "ddp_bucket_mb": ("bucket_mb", {"1": [0], "2": [1]}),
    "ddp_compress": ("compress", {"None": [0], "'bf16'": [1]}),
    "ddp_extra_parameter": ("parameter 0 name", {"0.weight": [0], "extra": [1]}),
    "ddp_requires_grad": ("parameter 1 ('0.bias') requires_grad", {"True": [0], "False": [1]}),
    "ddp_auto": ("bucket_mb", {"'auto'": [0], "4": [1]}),
    "wrapper": ("wrapper", {"ok.ddp": [0], "ok.GradBucketer": [1]}),
    "bucketer_bucket_mb": ("bucket_mb", {"1": [0], "0.5": [1]}),
    "bucketer_shape": ("parameter 4 ('4.weight') shape", {"(4, 32)": [0], "(32, 32)": [1]}),
    "bucketer_extra_parameter": ("parameter 0 name", {"0.weight": [0], "extra": [1]}),
    "fsdp_prefetch": ("prefetch", {"1": [0], "2": [1]}),
    "fsdp_shape": ("parameter 0 ('0.weight') shape", {"(32, 16)": [0], "(33, 16)": [1]}),
    "fsdp_mixed_precision": ("mixed_precision", {"None": [0], "'bf16'": [1]}),
    "fsdp_names": ("blocks", {"('0', '2', '4')": [0], "('inp', 'hidden', 'out')": [1]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_mismatched_ranks_both_raise_naming_first_difference_and_ranks(outcomes, case):
    field, values = EXPECTED[case]
    for rank in range(2):
        got = outcomes[rank][case]
        assert got["error"] is not None, f"rank {rank} accepted {case}"
        assert (got["field"], got["values"]) == (field, values), got["error"]
        sides = "; ".join(f"{v} on rank(s) {r}" for v, r in values.items())
        assert f"First difference: {field}: {sides}" in got["error"]
    # The same message on both sides (after the caller, which differs in the "wrapper" case).
    same = [outcomes[r][case]["error"].split(": ", 1)[1] for r in range(2)]
    assert same[0] == same[1]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp_same", "bucketer_same", "fsdp_same"])
def test_agreeing_ranks_pass_with_one_tiny_all_gather(outcomes, case):
    for rank in range(2):
        got = outcomes[rank][case]
        assert got["error"] is None
        # One tensor all-gather of 32 bytes per rank; the descriptions never travel.
        assert got["tensor_gathers"] == 1 and got["object_gathers"] == 0


@pytest.mark.slow
def test_a_rank_that_never_reaches_the_check_is_named_by_the_others(outcomes):
    assert outcomes[1]["unreached"].startswith("ValueError: ok.GradBucketer: bucket_mb must be > 0")
    assert (
        "ok.GradBucketer: all_gather of the consistency check (step 0) failed on rank 0: "
        "rank(s) [1] of the group [0, 1] never checked in"
    ) in outcomes[0]["unreached"]


# -- pure parts ---------------------------------------------------------------------------
def test_description_lists_wrapper_versions_options_and_every_parameter():
    fields = dict(describe("ok.ddp", make_mlp(), {"bucket_mb": "auto", "device_ids": [3]}))
    assert fields["wrapper"] == "ok.ddp"
    assert fields["overlapkit version"] == ok.__version__
    assert fields["torch version"] == torch.__version__
    assert fields["bucket_mb"] == "'auto'"  # compared as given, not as tuned
    assert "device_ids" not in fields  # legitimately per rank
    assert fields["parameter 5 name"] == "4.bias"
    assert fields["parameter 5 ('4.bias') shape"] == "(4,)"
    assert fields["parameter 5 ('4.bias') dtype"] == "float32"


def test_digest_is_32_bytes_and_changes_with_any_field():
    fields = describe("ok.ddp", make_mlp(), {"bucket_mb": 1})
    d = digest(fields)
    assert d.dtype == torch.int64 and d.numel() * d.element_size() == 32
    assert torch.equal(d, digest(list(fields)))
    changed = [*fields[:-1], (fields[-1][0], "False")]
    assert not torch.equal(d, digest(changed))


def test_first_difference_reports_versions_and_groups_ranks_by_value():
    base = [("wrapper", "ok.ddp"), ("overlapkit version", "0.1.0"), ("torch version", "2.13.0")]
    other = [base[0], base[1], ("torch version", "2.12.1")]
    field, values, count = first_difference([base, other, base])
    assert (field, values, count) == ("torch version", {"2.13.0": [0, 2], "2.12.1": [1]}, 1)
    assert first_difference([base, base]) is None


def test_extra_parameter_is_reported_as_absent_on_the_other_ranks():
    common = [("wrapper", "ok.ddp"), ("parameter 0 name", "w")]
    longer = [*common, ("parameter 1 name", "extra")]
    field, values, _ = first_difference([common, longer])
    assert (field, values) == ("parameter 1 name", {ABSENT: [0], "extra": [1]})


def test_mismatch_message_names_field_values_ranks_and_consequence():
    text = mismatch_message("ok.fsdp", "prefetch", {"1": [0, 2], "2": [1]}, 3)
    assert text == (
        "ok.fsdp: the ranks of the group were set up differently. First difference: prefetch: "
        "1 on rank(s) [0, 2]; 2 on rank(s) [1] (3 fields differ in all). Every rank must wrap "
        "the same model with the same options; a mismatch hangs the first collective or "
        "silently sums unrelated gradients"
    )
