"""Streaming reader for Chrome/Kineto trace files (``.pt.trace.json`` and ``.json.gz``).

``read_trace(path, on_event)`` calls ``on_event(event)`` once per element of the top-level
``traceEvents`` array and returns the other top-level keys (``distributedInfo``,
``deviceProperties``, ...). The file is read in chunks and each event is decoded on its own, so
a 100 MB trace never exists as one Python object tree; memory is bounded by what ``on_event``
keeps.

A file that is not a JSON object with a ``traceEvents`` array, that ends early (a worker killed
while writing) or that nests lists and objects deeper than ``MAX_DEPTH`` raises
``TraceFormatError`` naming the file and the character offset. ``on_event`` refuses an event by
raising ``EventError``; ``read_trace`` turns it into a ``TraceFormatError`` naming the file and the
event's index.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

CHUNK_CHARS = 1 << 22
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_TAIL_MARGIN = 64
MAX_DEPTH = 32
"""Deepest nesting of lists and objects accepted in one event or top-level value. Kineto's
deepest is 4 (event, ``args``, ``Input Dims``, one shape). The limit is the reader's own, so a
trace is accepted or refused alike on every Python version (json's C scanner recurses once per
level, and how deep it may go differs between interpreters)."""


class TraceFormatError(ValueError):
    """A file is not a readable profiler trace; the message names the file and the reason."""


class EventError(ValueError):
    """Raised by an ``on_event`` callback to refuse one event; the message says why.

    ``read_trace`` re-raises it as a ``TraceFormatError`` naming the file and the event's index.
    """


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


def open_text(path: Path) -> TextIO:
    """Open a trace for reading as text, decompressing ``.gz`` files."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


class _Reader:
    """A cursor over a text stream that refills its buffer as values are decoded."""

    def __init__(self, stream: TextIO, path: Path):
        self.stream = stream
        self.path = path
        self.buf = ""
        self.pos = 0
        self.consumed = 0  # characters dropped from the front of ``buf`` so far
        self.eof = False

    def _refill(self) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.consumed += self.pos
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def error(self, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}: {what} (at character {self.consumed + self.pos})")

    def peek(self) -> str:
        """The next non-whitespace character, or '' at end of file."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._refill():
                return ""

    def expect(self, char: str, context: str) -> None:
        found = self.peek()
        if found != char:
            if found == "":
                raise self.error(f"file ends early, expected {char!r} {context}; truncated?")
            raise self.error(f"expected {char!r} {context}, found {found!r}")
        self.pos += 1

    def value(self, context: str) -> Any:
        """Decode one JSON value, refilling until it is complete."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except RecursionError:  # json's C scanner recurses per nesting level
                raise self.error(f"{context} is nested too deeply to decode") from None
            except json.JSONDecodeError as err:
                # An error near the end of the buffer (or an unterminated string) may only mean
                # the value continues in the next chunk; an error earlier on is a broken file.
                unterminated = err.msg.startswith("Unterminated string")
                if (unterminated or err.pos >= len(self.buf) - _TAIL_MARGIN) and self._refill():
                    continue
                if unterminated or err.pos >= len(self.buf) - 1:
                    raise self.error(f"file ends early in {context}; truncated?") from None
                raise self.error(f"invalid JSON in {context}: {err.msg}") from None
            except ValueError:  # int() refuses literals longer than sys.get_int_max_str_digits()
                raise self.error(f"{context} holds an integer with too many digits") from None
            # A number (or literal) at the very end of the buffer may continue in the next chunk.
            if end == len(self.buf) and self._refill():
                continue
            if _too_deep(self.buf, self.pos, end, value):
                raise self.error(f"{context} is nested deeper than {MAX_DEPTH} levels")
            self.pos = end
            return value


def _read_events(reader: _Reader, on_event: Callable[[Any], None]) -> int:
    reader.expect("[", 'after "traceEvents":')
    count = 0
    if reader.peek() == "]":
        reader.pos += 1
        return 0
    # The C scanner behind raw_decode, without its Python wrapper: this loop runs per event.
    decode, separator_at = _DECODER.scan_once, _SEPARATOR.match
    try:
        while True:
            # Fast path: events wholly inside the buffer, one decode and one regex match each.
            buf, pos = reader.buf, reader.pos
            while True:
                try:
                    event, end = decode(buf, pos)
                except (ValueError, StopIteration, RecursionError):
                    break  # the slow path below decodes it again and names the problem
                separator = separator_at(buf, end)
                if separator is None or separator.end() == len(buf):
                    break  # the array's end, or the next event is not in the buffer yet
                if _too_deep(buf, pos, end, event):
                    break  # refused by the slow path, with the offset
                on_event(event)
                count += 1
                pos = separator.end()
            reader.pos = pos
            # Slow path for the event at the buffer's edge: refills, errors with context.
            on_event(reader.value(f"traceEvents[{count}]"))
            count += 1
            separator = reader.peek()
            if separator == ",":
                reader.pos += 1
            elif separator == "]":
                reader.pos += 1
                return count
            elif separator == "":
                raise reader.error(f"file ends early after traceEvents[{count - 1}]; truncated?")
            else:
                raise reader.error(f"expected ',' or ']' after traceEvents[{count - 1}]")
    except EventError as err:
        # on_event refused the event it was handed: the events before it make up the count.
        raise TraceFormatError(f"{reader.path}: traceEvents[{count}]: {err}") from None


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
            event ``on_event`` refused (the message names the file, and the event's index).
        OSError: the file cannot be opened.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    try:
        with open_text(path) as stream:
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
                        header["_event_count"] = _read_events(reader, on_event)
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
    except UnicodeDecodeError as err:
        raise TraceFormatError(f"{path}: not UTF-8 text ({err.reason})") from None
    if not seen_events:
        keys = ", ".join(sorted(header)) or "none"
        raise TraceFormatError(
            f'{path}: not a profiler trace: no "traceEvents" key (top-level keys: {keys})'
        )
    return header
