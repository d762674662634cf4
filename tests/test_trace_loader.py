"""The streaming trace reader: same events as json.load, any chunking; broken files named."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overlapkit.profiling import trace_loader
from overlapkit.profiling.trace_loader import TraceFormatError, read_trace

SAMPLE = {
    "schemaVersion": 1,
    "distributedInfo": {"backend": "gloo", "rank": 3, "world_size": 4},
    "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.5, "dur": 2e3, "args": {}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": 'a "b" ]}'}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 123456789012.25, "dur": 7, "pid": 0},
    ],
    "traceName": "x",
    "baseTimeNanoseconds": 1700000000000000000,
}


def _read(path):
    events = []
    header = read_trace(path, events.append)
    return header, events


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64, 1 << 22])
@pytest.mark.parametrize("suffix", [".pt.trace.json", ".pt.trace.json.gz"])
def test_events_and_header_equal_json_load_for_any_chunk_size(
    tmp_path, monkeypatch, chunk_bytes, suffix
):
    monkeypatch.setattr(trace_loader, "CHUNK_BYTES", chunk_bytes)
    path = tmp_path / f"rank3{suffix}"
    text = json.dumps(SAMPLE, indent=1)
    if suffix.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    header, events = _read(path)
    assert events == SAMPLE["traceEvents"]
    expected = {k: v for k, v in SAMPLE.items() if k != "traceEvents"}
    assert header == {**expected, "_event_count": 3, "_fast_events": 0}


def test_an_empty_event_list_is_a_trace(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [ ]}')
    assert _read(path) == ({"_event_count": 0, "_fast_events": 0}, [])


@pytest.mark.parametrize("cut", [1, 40, 150, 260, -2, -1])
def test_a_truncated_file_is_reported_by_name_as_truncated(tmp_path, monkeypatch, cut):
    monkeypatch.setattr(trace_loader, "CHUNK_BYTES", 16)
    text = json.dumps(SAMPLE)
    path = tmp_path / "rank0.123.pt.trace.json"
    path.write_text(text[:cut])
    pattern = r"rank0\.123\.pt\.trace\.json: .*(truncated|ends early)"
    with pytest.raises(TraceFormatError, match=pattern):
        _read(path)


def test_a_truncated_gzip_stream_is_reported_by_name(tmp_path):
    path = tmp_path / "rank1.9.pt.trace.json.gz"
    data = gzip.compress(json.dumps(SAMPLE).encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match=r"rank1\.9\.pt\.trace\.json\.gz: .*truncated"):
        _read(path)


def test_json_without_trace_events_is_not_a_trace(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"lr": 0.1, "steps": 10}))
    with pytest.raises(TraceFormatError, match=r"config\.json: not a profiler trace.*lr, steps"):
        _read(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("[1, 2]", "top level is not a JSON object"),
        ('{"traceEvents": [{"ph": "X"} {"ph": "X"}]}', r"expected ',' or '\]'"),
        ('{"traceEvents": [{"ph": "X", "ts": nope}], "x": 1}', "invalid JSON in traceEvents"),
        ('{"traceEvents": []} trailing', "unexpected data after"),
    ],
)
def test_malformed_json_names_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=rf"bad\.json: .*{message}"):
        _read(path)


def test_a_file_that_is_not_utf8_is_reported(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b'{"traceEvents": ["\xff\xfe"]}')
    with pytest.raises(TraceFormatError, match=r"binary\.json: not UTF-8"):
        _read(path)


# The nesting limit on every other Python this machine has (pyproject.toml: >= 3.10). json's C
# scanner recurses once per level, and how deep it may go changed in 3.12: a depth-3000 trace
# that 3.11 refuses is decoded by 3.13, so only the reader's own limit gives the same answer.
# trace_loader.py uses the standard library only, so it is loaded by path without torch.
_DEPTH_CHECK = textwrap.dedent(
    """
    import importlib.util, sys, tempfile
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("trace_loader", sys.argv[1])
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    path = Path(tempfile.mkdtemp()) / "deep.pt.trace.json"
    outcomes = []
    for depth in (reader.MAX_DEPTH, reader.MAX_DEPTH + 1, 3000, 100000):
        path.write_text('{"traceEvents": [' + "[" * depth + "]" * depth + "]}")
        try:
            reader.read_trace(path, lambda event: None)
            outcomes.append("read")
        except reader.TraceFormatError:
            outcomes.append("refused")
    print(" ".join(outcomes))
    """
)


def _other_pythons() -> list[str]:
    found = {
        str(path)
        for path in (Path.home() / ".pyenv" / "versions").glob("3.*/bin/python3")
        if int(path.parent.parent.name.split(".")[1]) >= 10
    }
    return sorted(found - {sys.executable}) or [pytest.param(None, marks=pytest.mark.skip("none"))]


@pytest.mark.parametrize("python", _other_pythons())
def test_trace_nesting_limit_holds_on_every_installed_python(python):
    done = subprocess.run(
        [python, "-c", _DEPTH_CHECK, trace_loader.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["read", "refused", "refused", "refused"]
