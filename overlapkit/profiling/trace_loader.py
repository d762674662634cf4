"""Streaming reader for Chrome/Kineto trace files (``.pt.trace.json`` and ``.json.gz``).

Two ways in, one reader:

- ``read_trace_batches(path, on_batch)`` hands the top-level ``traceEvents`` array to
  ``on_batch`` as lists of ``TraceEvent`` (``trace_events``), a few megabytes of file at a time:
  each run of whole events in the buffer is decoded by msgspec straight into the fields the
  analysis reads; a run its types refuse is decoded again with the standard library, event by
  event, and checked (``event_from_dict``), so both paths give the same events and errors.
- ``read_trace(path, on_event)`` calls ``on_event(event)`` once per element of the array with
  what ``json`` decodes (dicts), the reference the fast path is tested against.

Both return the other top-level keys (``distributedInfo``, ``deviceProperties``, ...). The file
is read in chunks of ``CHUNK_BYTES`` and never exists as one object tree; memory is bounded by
the chunk and by what the callback keeps.

A file that is not a JSON object with a ``traceEvents`` array, that ends early (a worker killed
while writing), that is not UTF-8 or that nests lists and objects deeper than ``MAX_DEPTH``
raises ``TraceFormatError`` naming the file, the reason and the byte offset (of the
uncompressed text, for ``.gz``). A callback refuses an event by raising ``EventError`` (with
``at``, its index in the batch, for ``on_batch``); the reader re-raises it as a
``TraceFormatError`` naming the file, the event's index and its byte offset.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from overlapkit.profiling.trace_events import (
    EventError,
    batch_decoder,
    decode_errors,
    event_from_dict,
)

__all__ = ["MAX_DEPTH", "EventError", "TraceFormatError", "read_trace", "read_trace_batches"]

CHUNK_BYTES = 1 << 22
_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_TAIL_MARGIN = 64
_FIRST_WINDOW = 1 << 16  # bytes decoded to text for one value at first (doubled as needed)
MAX_DEPTH = 32
"""Deepest nesting of lists and objects accepted in one event or top-level value. Kineto's
deepest is 4 (event, ``args``, ``Input Dims``, one shape). The limit is the reader's own, so a
trace is accepted or refused alike on every Python version (json's C scanner and msgspec recurse
once per level, and how deep they may go differs between interpreters)."""

# What the depth check keeps of a run of events: brackets, and quotes to tell strings apart.
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))


class TraceFormatError(ValueError):
    """A file is not a readable profiler trace; the message names the file and the reason."""


def _nesting(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), counted without recursion
    and only up to just past ``MAX_DEPTH``."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        pending.extend((child, depth + 1) for child in item)
    return deepest


def _too_deep(text: str, start: int, end: int, value: Any) -> bool:
    """Whether ``value``, decoded from ``text[start:end]``, nests deeper than ``MAX_DEPTH``."""
    # Counting brackets is C-speed and bounds the depth from above (brackets inside strings only
    # overestimate it); the exact walk runs only for the rare event with many brackets.
    if text.count("[", start, end) + text.count("{", start, end) <= MAX_DEPTH:
        return False
    return _nesting(value) > MAX_DEPTH


def _shallow(run: bytes) -> bool:
    """Whether no value in ``run`` (whole JSON values separated by commas, valid JSON) nests
    deeper than ``MAX_DEPTH``, found with a few C-speed passes: the fast path skips the keys it
    does not read, so without this a deep value there would pass where the standard library
    refuses it.

    Escapes go first (a run of backslashes keeps its parity; an escaped quote then goes), so
    every quote left opens or closes a string, in turn; everything but quotes and brackets
    goes. The running sum of +1 per opening and -1 per closing bracket outside strings is the
    depth. A string holds brackets where its two quotes are not adjacent (NCCL's
    ``"[0, 1, ...]"``); those brackets are masked, between the string's quotes' positions.
    """
    # numpy only here: this module stays standard-library-only without the fast path (msgspec,
    # and so numpy, may be missing: tests/test_trace_loader.py runs it on other Pythons).
    import numpy as np

    if b"\\" in run:
        run = run.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = run.translate(None, _NOT_STRUCTURE)
    quotes = np.flatnonzero(np.frombuffer(structure, np.uint8) == ord('"'))
    opens, closes = quotes[0::2], quotes[1::2]
    holding = np.flatnonzero(closes - opens > 1)
    brackets = structure.translate(None, b'"')
    if not brackets:
        return True
    step = _bracket_step()[np.frombuffer(brackets, np.uint8)]
    if len(holding):
        # Without its quotes, the k-th string's content starts 2k places earlier, at
        # opens - 2k, and ends before closes - 2k - 1.
        inside = np.zeros(len(brackets) + 1, np.int32)
        inside[opens[holding] - 2 * holding] += 1
        inside[closes[holding] - 2 * holding - 1] -= 1
        step[np.cumsum(inside[:-1]) > 0] = 0
    return int(np.cumsum(step, dtype=np.int32).max()) <= MAX_DEPTH


def _bracket_step():
    import numpy as np

    step = np.zeros(256, np.int8)
    step[[ord("["), ord("{")]] = 1
    step[[ord("]"), ord("}")]] = -1
    return step


def open_text(path: Path) -> TextIO:
    """Open a trace for reading as text, decompressing ``.gz`` files."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


class _Reader:
    """A cursor over a byte stream that refills its buffer as values are decoded.

    ``raw[pos:]`` is what is not consumed yet; ``base`` is the file offset of ``raw[0]``.
    """

    def __init__(self, stream: BinaryIO, path: Path):
        self.stream = stream
        self.path = path
        self.raw = b""
        self.pos = 0
        self.base = 0
        self.eof = False

    def refill(self) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(CHUNK_BYTES)
        if not chunk:
            self.eof = True
            return False
        self.base += self.pos
        self.raw = self.raw[self.pos :] + chunk
        self.pos = 0
        return True

    def error(self, what: str, at: int | None = None) -> TraceFormatError:
        """``what`` at buffer index ``at`` (default: the cursor), as a file byte offset."""
        offset = self.base + (self.pos if at is None else at)
        return TraceFormatError(f"{self.path}: {what} (at byte {offset})")

    def peek(self) -> str:
        """The next non-whitespace character, or '' at end of file."""
        while True:
            self.pos = _WHITESPACE.match(self.raw, self.pos).end()
            if self.pos < len(self.raw):
                return chr(self.raw[self.pos])
            if not self.refill():
                return ""

    def expect(self, char: str, context: str) -> None:
        found = self.peek()
        if found != char:
            if found == "":
                raise self.error(f"file ends early, expected {char!r} {context}; truncated?")
            raise self.error(f"expected {char!r} {context}, found {found!r}")
        self.pos += 1

    def text(self, limit: int | None = None) -> tuple[str, Callable[[int], int], bool]:
        """Up to ``limit`` bytes of the buffer from the cursor as text, a map from a character
        index in it to a buffer index, and whether it reaches the end of the buffer. A
        character cut by the end is left out."""
        end = len(self.raw) if limit is None else min(len(self.raw), self.pos + limit)
        whole = end == len(self.raw)
        try:
            text, _ = codecs.utf_8_decode(self.raw[self.pos : end], "strict", whole and self.eof)
        except UnicodeDecodeError as err:
            raise self.error(f"not UTF-8 text ({err.reason})", self.pos + err.start) from None
        if text.isascii():
            return text, lambda i: self.pos + i, whole
        return text, lambda i: self.pos + len(text[:i].encode("utf-8")), whole

    def value(self, context: str) -> Any:
        """Decode one JSON value at the cursor, refilling until it is complete."""
        self.peek()
        window = _FIRST_WINDOW
        while True:
            text, to_buffer, whole = self.text(window)
            more = not whole or not self.eof
            try:
                value, end = _DECODER.raw_decode(text, 0)
            except RecursionError:  # json's C scanner recurses per nesting level
                raise self.error(f"{context} is nested too deeply to decode") from None
            except json.JSONDecodeError as err:
                # An error near the end of the text (or an unterminated string) may only mean
                # the value continues further on; an error earlier on is a broken file.
                unterminated = err.msg.startswith("Unterminated string")
                if (unterminated or err.pos >= len(text) - _TAIL_MARGIN) and more:
                    if whole:
                        self.refill()
                    window *= 2
                    continue
                at = to_buffer(err.pos)
                if unterminated or err.pos >= len(text) - 1:
                    raise self.error(f"file ends early in {context}; truncated?", at) from None
                raise self.error(f"invalid JSON in {context}: {err.msg}", at) from None
            except ValueError:  # int() refuses literals longer than sys.get_int_max_str_digits()
                raise self.error(f"{context} holds an integer with too many digits") from None
            # A number (or literal) at the very end of the text may continue further on.
            if end == len(text) and more:
                if whole:
                    self.refill()
                window *= 2
                continue
            if _too_deep(text, 0, end, value):
                raise self.error(f"{context} is nested deeper than {MAX_DEPTH} levels")
            self.pos = to_buffer(end)
            return value


def _event_offset(reader: _Reader, start: int, k: int) -> int:
    """The file offset of the ``k``-th event of the run of whole events at buffer ``start``."""
    text, _ = codecs.utf_8_decode(reader.raw[start:], "replace", False)
    idx = 0
    for _ in range(k):
        idx = _SEPARATOR.match(text, _DECODER.scan_once(text, idx)[1]).end()
    return reader.base + start + len(text[:idx].encode("utf-8", "replace"))


class _Events:
    """The ``traceEvents`` array, decoded run by run into ``sink(events)``."""

    def __init__(self, reader: _Reader, sink: Callable[[list], None], convert: bool):
        self.reader = reader
        self.sink = sink
        self.convert = convert
        self.decode = batch_decoder() if convert else None
        self.refused = decode_errors()
        self.count = 0
        self.fast = 0  # events the fast path decoded

    def _refusal(self, err: EventError, k: int, offset_of: Callable[[int], int]) -> Exception:
        return TraceFormatError(
            f"{self.reader.path}: traceEvents[{self.count + k}]: {err} (at byte {offset_of(k)})"
        )

    def deliver(self, events: list, offset_of: Callable[[int], int], stdlib: bool) -> None:
        """Hand ``events``, the next elements of the array, to the sink (as ``TraceEvent``s
        when converting ``stdlib``-decoded ones); ``offset_of(k)`` is the file offset of the
        ``k``-th, for naming a refused one."""
        positions = None
        if stdlib and self.convert:
            kept, positions = [], []
            for k, event in enumerate(events):
                try:
                    converted = event_from_dict(event)
                except EventError as err:
                    raise self._refusal(err, k, offset_of) from None
                if converted is not None:
                    kept.append(converted)
                    positions.append(k)
            events_in = len(events)
            events = kept
        else:
            events_in = len(events)
        try:
            self.sink(events)
        except EventError as err:
            k = getattr(err, "at", 0)
            raise self._refusal(err, positions[k] if positions else k, offset_of) from None
        self.count += events_in

    def fast_run(self) -> bool:
        """Decode the whole events in the buffer with msgspec; False when its types refuse
        them (or there are none), leaving the cursor where it was."""
        reader = self.reader
        start = reader.pos
        cut = reader.raw.rfind(b"},", start)
        if cut < 0:
            return False
        run = reader.raw[start : cut + 1]
        try:
            events = self.decode(b"[" + run + b"]")
        except self.refused:
            return False
        if not _shallow(run):
            return False
        reader.pos = cut + 2
        self.deliver(events, lambda k: _event_offset(reader, start, k), stdlib=False)
        self.fast += len(events)
        return True

    def slow_run(self) -> None:
        """Decode the events wholly inside the buffer one by one with the standard library."""
        reader = self.reader
        text, to_buffer, _ = reader.text()
        decode, separator_at = _DECODER.scan_once, _SEPARATOR.match
        events, offsets, idx = [], [], 0
        while True:
            try:
                event, end = decode(text, idx)
            except (ValueError, StopIteration, RecursionError):
                break  # the edge path decodes it again and names the problem
            separator = separator_at(text, end)
            if separator is None or separator.end() == len(text):
                break  # the array's end, or the next event is not in the buffer yet
            if _too_deep(text, idx, end, event):
                break  # refused by the edge path, with the offset
            events.append(event)
            offsets.append(reader.base + to_buffer(idx))
            idx = separator.end()
        reader.pos = to_buffer(idx)
        if events:
            self.deliver(events, offsets.__getitem__, stdlib=True)

    def read(self) -> int:
        reader = self.reader
        reader.expect("[", 'after "traceEvents":')
        if reader.peek() == "]":
            reader.pos += 1
            return 0
        while True:
            if self.decode is None or not self.fast_run():
                self.slow_run()
            # The event at the buffer's edge: refills, errors with context.
            offset = [reader.base + reader.pos]
            event = reader.value(f"traceEvents[{self.count}]")
            self.deliver([event], offset.__getitem__, stdlib=True)
            separator = reader.peek()
            if separator == ",":
                reader.pos += 1
                reader.peek()
            elif separator == "]":
                reader.pos += 1
                return self.count
            elif separator == "":
                raise reader.error(
                    f"file ends early after traceEvents[{self.count - 1}]; truncated?"
                )
            else:
                raise reader.error(f"expected ',' or ']' after traceEvents[{self.count - 1}]")


def _read(path: str | Path, sink: Callable[[list], None], convert: bool) -> dict[str, Any]:
    path = Path(path)
    header: dict[str, Any] = {}
    try:
        with _open_binary(path) as stream:
            reader = _Reader(stream, path)
            first = reader.peek()
            if first == "":
                raise reader.error("empty file")
            if first != "{":
                raise reader.error(f"not a trace: the top level is not a JSON object ({first!r})")
            reader.pos += 1
            seen_events = False
            if reader.peek() == "}":
                reader.pos += 1
            else:
                while True:
                    key = reader.value("a top-level key")
                    if not isinstance(key, str):
                        raise reader.error(f"invalid JSON: top-level key {key!r} is not a string")
                    reader.expect(":", f"after key {key!r}")
                    if key == "traceEvents":
                        events = _Events(reader, sink, convert)
                        header["_event_count"] = events.read()
                        header["_fast_events"] = events.fast
                        seen_events = True
                    else:
                        header[key] = reader.value(f"top-level key {key!r}")
                    separator = reader.peek()
                    if separator == ",":
                        reader.pos += 1
                    elif separator == "}":
                        reader.pos += 1
                        break
                    elif separator == "":
                        raise reader.error(f"file ends early after key {key!r}; truncated?")
                    else:
                        raise reader.error(f"expected ',' or '}}' after key {key!r}")
            if reader.peek() != "":
                raise reader.error("unexpected data after the top-level object")
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise TraceFormatError(f"{path}: broken gzip stream ({err}); truncated?") from None
    if not seen_events:
        keys = ", ".join(sorted(header)) or "none"
        raise TraceFormatError(
            f'{path}: not a profiler trace: no "traceEvents" key (top-level keys: {keys})'
        )
    return header


def read_trace_batches(path: str | Path, on_batch: Callable[[list], None]) -> dict[str, Any]:
    """Stream ``path``'s events into ``on_batch(events)`` as lists of ``TraceEvent``s.

    A batch may hold events the analysis does not keep (the fast path hands over what it
    decoded; the other drops them): the callback filters. ``on_batch`` may raise ``EventError``
    with ``at`` set to the refused event's position in the batch.

    Returns:
        dict: the top-level keys other than ``traceEvents``, plus ``"_event_count"`` and
        ``"_fast_events"`` (how many of them the fast path decoded).

    Raises:
        TraceFormatError: as ``read_trace``, and for a kept event whose fields the analysis
            cannot use (``trace_events.event_from_dict``).
        OSError: the file cannot be opened.
    """
    return _read(path, on_batch, convert=True)


def read_trace(path: str | Path, on_event: Callable[[Any], None]) -> dict[str, Any]:
    """Stream ``path``'s ``traceEvents`` into ``on_event``; return the other top-level keys.

    Args:
        path (str | Path): a ``.json`` or ``.json.gz`` Chrome/Kineto trace.
        on_event (Callable): called with each event (usually a dict) in file order; it may
            raise ``EventError`` to refuse the event.

    Returns:
        dict: the top-level keys other than ``traceEvents``, plus ``"_event_count"``.

    Raises:
        TraceFormatError: not a JSON object with a ``traceEvents`` list, invalid JSON, values
            nested deeper than ``MAX_DEPTH``, a truncated file, a broken gzip stream, or an
            event ``on_event`` refused (the message names the file, the event's index and the
            byte offset).
        OSError: the file cannot be opened.
    """

    def each(events: list) -> None:
        for k, event in enumerate(events):
            try:
                on_event(event)
            except EventError as err:
                err.at = k
                raise

    return _read(path, each, convert=False)
