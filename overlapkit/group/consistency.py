"""Wrap-time check that every rank of a group wraps the same model with the same options.

Ranks that disagree fail late and obscurely: a different parameter shape or bucket size gives
buckets of different sizes (gloo or NCCL then hang or error in the first backward), a different
parameter order or name sums unrelated gradients without any error, and a different compression
or prefetch depth issues different collectives (a hang at the collective timeout). So ``ok.ddp``,
``ok.GradBucketer`` and ``ok.fsdp`` describe their configuration (wrapper, overlapkit and torch
versions, options as the user passed them, and every parameter's name, shape, dtype and
``requires_grad``) and compare it across the group before their first collective:

- healthy path: **one** ``all_gather_single`` of a 32-byte SHA-256 digest per rank (4
  int64), nothing else;
- mismatch: every rank sees the same differing digests, so all of them take a second collective
  (``all_gather_object`` of the full descriptions) and raise the same ``ConfigMismatch`` naming
  the first differing field, its value on each side and the ranks holding each value.

Options are described as given: ``bucket_mb="auto"`` is compared as ``"auto"``, never as the size
a rank tuned itself to later.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from overlapkit._version import __version__
from overlapkit.group.failures import FailureScope
from overlapkit.group.process_group import all_gather_single

logger = logging.getLogger(__name__)

ABSENT = "(absent)"
# Options that legitimately differ per rank (each rank's own device).
PER_RANK_OPTIONS = frozenset({"device_ids", "output_device"})


class ConfigMismatch(ValueError):
    """Ranks of a group wrapped different models or used different options.

    Attributes:
        field (str): the first field that differs, e.g. ``"bucket_mb"`` or
            ``"parameter 2 shape"``.
        values (dict[str, list[int]]): each value of that field and the global ranks holding it.
    """

    def __init__(self, message: str, *, field: str, values: dict[str, list[int]]):
        super().__init__(message)
        self.field = field
        self.values = values


def describe(
    caller: str, model: torch.nn.Module, options: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """The fields compared across ranks, in order: wrapper, versions, options, parameters.

    Args:
        caller (str): the wrapper (``"ok.ddp"``).
        model (nn.Module): the model being wrapped (all its parameters, frozen ones included).
        options (Mapping): the options as the user passed them; ``PER_RANK_OPTIONS`` are left
            out.
    """
    fields = [
        ("wrapper", caller),
        ("overlapkit version", __version__),
        ("torch version", torch.__version__),
    ]
    fields += [(k, repr(v)) for k, v in sorted(options.items()) if k not in PER_RANK_OPTIONS]
    for i, (name, p) in enumerate(model.named_parameters()):
        shape = tuple(p.shape)
        fields += [
            (f"parameter {i} name", name),
            (f"parameter {i} ({name!r}) shape", str(shape)),
            (f"parameter {i} ({name!r}) dtype", str(p.dtype).removeprefix("torch.")),
            (f"parameter {i} ({name!r}) requires_grad", str(p.requires_grad)),
        ]
    return fields


def digest(fields: Sequence[tuple[str, str]]) -> torch.Tensor:
    """SHA-256 of the fields as 4 int64 (32 bytes), the only thing the healthy path sends."""
    raw = hashlib.sha256(json.dumps(list(fields)).encode()).digest()
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).clone()


def first_difference(
    descriptions: Sequence[Sequence[tuple[str, str]]],
) -> tuple[str, dict[str, list[int]], int] | None:
    """The first field whose value is not the same on every description, or None.

    Fields are matched by key, in the order of the longest description (so an extra parameter
    on one rank is reported as that parameter, absent elsewhere). ``descriptions[i]`` belongs
    to group rank ``i``.

    Returns:
        tuple: (field, {value: [ranks holding it]}, number of differing fields), or None when
        all descriptions agree.
    """
    longest = max(descriptions, key=len)
    keys = [k for k, _ in longest]
    seen = set(keys)
    for d in descriptions:
        for k, _ in d:
            if k not in seen:
                keys.append(k)
                seen.add(k)
    as_dicts = [dict(d) for d in descriptions]
    first = None
    count = 0
    for key in keys:
        values: dict[str, list[int]] = {}
        for rank, d in enumerate(as_dicts):
            values.setdefault(d.get(key, ABSENT), []).append(rank)
        if len(values) > 1:
            count += 1
            if first is None:
                first = (key, values)
    return None if first is None else (*first, count)


def mismatch_message(caller: str, field: str, values: dict[str, list[int]], count: int) -> str:
    """The ``ConfigMismatch`` message (a pure function of the difference)."""
    sides = "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in values.items())
    more = f" ({count} fields differ in all)" if count > 1 else ""
    return (
        f"{caller}: the ranks of the group were set up differently. First difference: "
        f"{field}: {sides}{more}. Every rank must wrap the same model with the same options; "
        "a mismatch hangs the first collective or silently sums unrelated gradients"
    )


def _device_for(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    return torch.accelerator.current_accelerator() or torch.device("cpu")


def check_consistent(
    model: torch.nn.Module,
    group: dist.ProcessGroup,
    *,
    caller: str,
    options: Mapping[str, Any],
) -> None:
    """Raise ``ConfigMismatch`` unless every rank of ``group`` describes the same configuration.

    Collective: every rank of ``group`` must call it. Costs one ``all_gather_single`` of
    32 bytes per rank when the ranks agree.

    Args:
        model (nn.Module): the model being wrapped, before wrapping.
        group (ProcessGroup): the group the wrapper communicates over.
        caller (str): the wrapper, as the user spells it.
        options (Mapping): the wrapper's options as the user passed them.

    Raises:
        ConfigMismatch: the ranks differ; the message names the first difference and the ranks.
        CollectiveFailure: a rank never reached the check (it died, is stuck, or failed its own
            argument checks); the message names it.
    """
    fields = describe(caller, model, options)
    size = group.size()
    if size == 1:
        return
    mine = digest(fields).to(_device_for(group))
    gathered = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
    site = FailureScope(caller, lambda: 0).site(group, "all_gather", "the consistency check")
    try:
        all_gather_single(gathered, mine, group=group)
    except RuntimeError as error:
        raise site.explain(error) from error
    if bool((gathered.view(size, -1) == mine).all()):
        return
    descriptions: list[list[tuple[str, str]] | None] = [None] * size
    dist.all_gather_object(descriptions, fields, group=group)
    difference = first_difference(descriptions)
    assert difference is not None, "digests differ but descriptions agree"
    field, by_group_rank, count = difference
    ranks = dist.get_process_group_ranks(group)
    values = {value: [ranks[r] for r in members] for value, members in by_group_rank.items()}
    raise ConfigMismatch(mismatch_message(caller, field, values, count), field=field, values=values)
