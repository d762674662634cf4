"""The fields of a trace event that the analysis reads, decoded fast or checked one by one.

A Kineto event has a dozen keys and its ``args`` a dozen more; the analysis needs a few of them.
``TraceEvent`` and ``EventArgs`` declare those few. With msgspec installed (a dependency of
overlapkit; the standard library is the fallback) whole runs of events are decoded straight into
them, typed: unknown keys are skipped without building objects, and every declared field is
checked against its type while decoding (``batch_decoder``). That is what makes reading a trace
fast: about 5x ``json.loads`` on a GPU trace (``python -m bench.trace_scale``).

The types are the contract of the fast path, so they are strict: whatever they let through is a
value the analysis accepts. A run of events the types refuse (a non-object event, a ``"ts"``
given as a string, a count below zero, ...) is decoded again by the standard library event by
event and each event is checked by ``event_from_dict``, which accepts what the types accept and
more (a float process id, a whole float count) and refuses the rest with a message naming the
field and the value. So a trace reads the same, and fails with the same message, whichever path
decoded it; the fast path only decides how soon.

Only events the analysis keeps are checked (complete events, ``"ph": "X"``, of the categories in
``KEPT_CATEGORIES``, with a time); the others are dropped. The checks that need two fields
(``"ts" + "dur"``, bytes = elements x element size) are the collector's, on both paths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Union

try:  # the fast path; without it every event takes the standard library's
    import msgspec
except ImportError:  # pragma: no cover - exercised by tests/test_trace_events.py in a subprocess
    msgspec = None

MAX_COUNT = 2**63 - 1
"""Largest element count, dimension, byte size or step number accepted: torch sizes are int64."""
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
KEPT_CATEGORIES = LAUNCH_CATEGORIES | {"kernel", "cpu_op", "user_annotation"}

Identifier = int | str | None
Count = (Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] if msgspec else int) | None
OptionalStr = str | None

# (attribute, key in the trace, type for the fast path, how event_from_dict checks it).
# "raw" fields stay undecoded (msgspec.Raw) until a gloo range needs them.
_ARG_FIELDS = (
    ("correlation", "correlation", Identifier, "identifier"),
    ("external_id", "External id", Identifier, "identifier"),
    ("collective", "Collective name", OptionalStr, "text"),
    ("nelems", "In msg nelems", Count, "count"),
    ("dtype", "dtype", OptionalStr, "text"),
    ("group_name", "Process Group Name", OptionalStr, "text"),
    ("group_ranks", "Process Group Ranks", OptionalStr, "ranks"),
    ("seq", "Seq", Count, "count"),
    ("input_dims", "Input Dims", "raw", "raw"),
    ("input_types", "Input type", "raw", "raw"),
)
_EVENT_FIELDS = (
    ("cat", "cat", OptionalStr),
    ("name", "name", OptionalStr),
    ("pid", "pid", Identifier),
    ("tid", "tid", Identifier),
    ("ts", "ts", float | None),
    ("dur", "dur", (Annotated[float, msgspec.Meta(ge=0)] if msgspec else float) | None),
)


def _build_types():
    if msgspec is None:
        args = dataclasses.make_dataclass(
            "EventArgs",
            [(a, Any, dataclasses.field(default=None)) for a, *_ in _ARG_FIELDS],
            slots=True,
        )
        event = dataclasses.make_dataclass(
            "TraceEvent",
            [(a, Any, dataclasses.field(default=None)) for a, *_ in _EVENT_FIELDS]
            + [("args", Any, dataclasses.field(default=None))],
            slots=True,
        )
        return args, event
    # A Raw field cannot be optional (``Raw | None`` is no union msgspec decodes): an empty Raw
    # stands for an absent key (``raw_value`` gives None for it).
    args = msgspec.defstruct(
        "EventArgs",
        [
            (attr, msgspec.Raw, msgspec.field(default=msgspec.Raw(), name=key))
            if kind == "raw"
            else (attr, kind, msgspec.field(default=None, name=key))
            for attr, key, kind, _ in _ARG_FIELDS
        ],
        gc=False,  # scalars only: no reference cycles, so the collector need not track them
    )
    # Tagged by "ph": a complete event ("X") is a TraceEvent; every other phase of the Chrome
    # trace format decodes into an empty struct, its keys skipped (a fifth faster on a GPU
    # trace, where flow arrows are two events of five). A phase not listed fails the run, which
    # the standard library then reads.
    event = msgspec.defstruct(
        "TraceEvent",
        [(a, t, msgspec.field(default=None, name=k)) for a, k, t in _EVENT_FIELDS]
        + [("args", args | None, None)],
        gc=False,
        tag_field="ph",
        tag="X",
    )
    return args, event


EventArgs, TraceEvent = _build_types()
EventArgs.__doc__ = "The ``args`` keys the analysis reads (None when absent)."
TraceEvent.__doc__ = (
    "A complete event (``ph`` X): the keys the analysis reads (None when absent); ``args`` may "
    "be None."
)
NO_ARGS = EventArgs()
_OTHER_PHASES = (
    "B",
    "E",
    "i",
    "I",
    "C",
    "b",
    "n",
    "e",
    "s",
    "t",
    "f",
    "P",
    "O",
    "N",
    "D",
    "M",
    "V",
    "v",
    "R",
    "c",
    "(",
    ")",
)
"""The Chrome trace format's phases other than X."""


def batch_decoder():
    """A function decoding ``b"[" + events + b"]"`` into a list of ``TraceEvent`` (complete
    events) and empty structs (the other phases), or None without msgspec. It raises
    ``msgspec.DecodeError`` / ``ValidationError`` / ``RecursionError`` where the types refuse
    the bytes; the caller then decodes them with the standard library."""
    if msgspec is None:
        return None
    others = [
        msgspec.defstruct(f"Phase{ord(ph)}", [], gc=False, tag_field="ph", tag=ph)
        for ph in _OTHER_PHASES
    ]
    return msgspec.json.Decoder(list[Union[(TraceEvent, *others)]]).decode


def decode_errors() -> tuple[type[BaseException], ...]:
    """The exceptions ``batch_decoder``'s function raises for bytes its types refuse."""
    if msgspec is None:
        return ()
    return (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class EventError(ValueError):
    """Raised to refuse one event; the message says why.

    The reader re-raises it as a ``TraceFormatError`` naming the file and the event's index.
    """


def shown(value: Any) -> str:
    """``repr(value)``, shortened: a refused value may be a 300-digit number."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def check_time(value: Any, field: str) -> float:
    """``value`` in µs as a float; ``EventError`` unless it is a finite number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond 1.8e308: JSON allows any number of digits
            number = math.inf
        if math.isfinite(number):
            return number
    raise EventError(f"{field} is {shown(value)}; expected a finite number of µs")


def check_duration(value: Any) -> float:
    """A ``"dur"`` in µs; ``EventError`` unless it is a finite number >= 0."""
    dur = check_time(value, '"dur"')
    if dur < 0:
        raise EventError(f'"dur" is {shown(value)}; expected a duration >= 0 µs')
    return dur


def check_count(value: Any, field: str) -> int:
    """``value`` as an int; ``EventError`` unless it is a whole number in ``[0, 2**63)``."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 0 <= value <= MAX_COUNT:
        raise EventError(f"{field} is {shown(value)}; expected a whole number in [0, 2**63)")
    return int(value)


def check_identifier(value: Any, field: str) -> Any:
    """``value`` if it can key a dict (ids match launches to kernels); else ``EventError``."""
    if isinstance(value, (list, dict)):
        raise EventError(f"{field} is {shown(value)}; expected a number or a string")
    return value


def _check_ranks(value: Any, field: str) -> str | None:
    """``Process Group Ranks`` as Kineto writes it (a string such as ``"[0, 1]"``) or a list."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(r, int) and not isinstance(r, bool) for r in value
    ):
        return "[" + ", ".join(map(str, value)) + "]"
    raise EventError(f"{field} is {shown(value)}; expected the group's ranks, e.g. '[0, 1]'")


def _checked_arg(value: Any, key: str, how: str) -> Any:
    field = f'"{key}"'
    if value is None or how == "raw":
        return value
    if how == "identifier":
        return check_identifier(value, field)
    if how == "count":
        return check_count(value, field)
    if how == "ranks":
        return _check_ranks(value, field)
    return value if isinstance(value, str) else str(value)


def event_from_dict(event: Any) -> TraceEvent | None:
    """The ``TraceEvent`` of one event decoded by the standard library, or None when the
    analysis does not keep it (see the module docstring).

    Raises:
        EventError: a kept event has a field the analysis cannot use; the message starts with
            the event's name and names the field and the value.
    """
    if type(event) is not dict or event.get("ph") != "X" or event.get("ts") is None:
        return None
    cat = event.get("cat")
    if not isinstance(cat, str) or cat.lower() not in KEPT_CATEGORIES:
        return None
    name = event.get("name")
    name = name if isinstance(name, str) else str(name)
    try:
        ts = check_time(event["ts"], '"ts"')
        dur = event.get("dur")
        dur = None if dur is None else check_duration(dur)
        pid = check_identifier(event.get("pid"), '"pid"')
        tid = check_identifier(event.get("tid"), '"tid"')
        args = event.get("args")
        if isinstance(args, dict):
            args = EventArgs(
                **{attr: _checked_arg(args.get(key), key, how) for attr, key, _, how in _ARG_FIELDS}
            )
        else:
            args = None
    except EventError as err:
        raise EventError(f"{shown(name)}: {err}") from None
    return TraceEvent(cat=cat, name=name, pid=pid, tid=tid, ts=ts, dur=dur, args=args)


def raw_value(value: Any) -> Any:
    """A ``raw`` field's value: decoded from JSON on the fast path (None for an empty Raw: the
    key was absent), as it is on the other."""
    if msgspec is not None and isinstance(value, msgspec.Raw):
        return msgspec.json.decode(value) if len(value) else None
    return value
