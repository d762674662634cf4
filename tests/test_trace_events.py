"""The fast path (msgspec, typed) reads every trace as the standard library does, or refuses it
with the same message; without msgspec the analysis gives the same numbers."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.harness.synthetic_traces import TraceBuilder
from overlapkit.profiling import trace_loader
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.rank_trace import load_rank_trace
from overlapkit.profiling.trace_events import KEPT_CATEGORIES, TraceEvent, event_from_dict
from overlapkit.profiling.trace_loader import (
    MAX_DEPTH,
    TraceFormatError,
    read_trace,
    read_trace_batches,
)

msgspec = pytest.importorskip("msgspec", reason="the fast path needs msgspec (a dependency)")


def _gpu_trace(seed: int) -> TraceBuilder:
    rng = random.Random(seed)
    t = TraceBuilder(rank=1, world_size=4, groups=[{"pg_name": "0", "ranks": [0, 1, 2, 3]}])
    for n in range(4):
        start = 1e6 + n * 5000.0
        t.step(n + 1, start, start + 5000)
        cursor = start + 10
        for k in range(rng.randint(3, 12)):
            dur = round(rng.uniform(5, 300), 3)
            t.cpu_op(f"aten::op_{k}", cursor - 3, cursor + 1, args={"Input Dims": [[3, 4], []]})
            t.kernel(f"kernel_{k % 3}<float>", cursor, cursor + dur, launch_at=cursor - 2)
            cursor += dur + rng.uniform(0, 20)
        t.kernel(
            "ncclDevKernel_AllReduce",
            cursor,
            cursor + 200,
            launch_at=cursor - 5,
            stream=20,
            collective="allreduce",
            nelems=rng.randint(1, 1 << 20),
            seq=n,
        )
    # Kineto's other keys and shapes: metadata, flows, counters, instant events, odd ids.
    t.events.append(
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 1e6}
    )
    t.events.append({"ph": "C", "name": "mem", "pid": 1, "ts": 1e6, "args": {"bytes": 12}})
    t.events.append(
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 1e6,
            "dur": 3e4,
            "args": {"Op count": 0},
        }
    )
    return t


def _layouts(document: dict) -> dict[str, str]:
    """The same document as Kineto writes it (indented) and as json.dumps does (one line)."""
    return {"indented": json.dumps(document, indent=2), "compact": json.dumps(document)}


def _both_paths(path):
    """The kept events by the fast path and by the standard library (then checked)."""
    fast, slow = [], []
    read_trace_batches(path, lambda batch: fast.extend(batch))
    read_trace(path, lambda event: slow.append(event_from_dict(event)))
    keep = [
        e
        for e in fast
        if type(e) is TraceEvent and e.ts is not None and str(e.cat).lower() in KEPT_CATEGORIES
    ]
    return keep, [e for e in slow if e is not None]


def _same(fast, slow) -> None:
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        for field in ("cat", "name", "pid", "tid", "ts", "dur"):
            assert getattr(a, field) == getattr(b, field), (field, a, b)
        for field in (
            "correlation",
            "external_id",
            "collective",
            "nelems",
            "dtype",
            "seq",
            "group_name",
            "group_ranks",
        ):
            assert getattr(a.args, field, None) == getattr(b.args, field, None), (field, a, b)


@pytest.mark.parametrize("chunk", [97, 4096, 1 << 22])
@pytest.mark.parametrize("layout", ["indented", "compact"])
@pytest.mark.parametrize("seed", [1, 2])
def test_fast_and_standard_library_paths_give_the_same_events(
    tmp_path, monkeypatch, chunk, layout, seed
):
    monkeypatch.setattr(trace_loader, "CHUNK_BYTES", chunk)
    path = tmp_path / "rank1.pt.trace.json"
    path.write_text(_layouts(_gpu_trace(seed).to_dict())[layout])
    fast, slow = _both_paths(path)
    assert len(fast) > 40
    _same(fast, slow)


@pytest.mark.parametrize("layout", ["indented", "compact"])
def test_the_fast_path_decodes_kineto_shaped_traces_with_shapes_and_metadata(tmp_path, layout):
    """Events with ``Input Dims``, collective metadata, string ids: none sends a run to the
    standard library (that would be correct, only slow, so equality tests cannot see it)."""
    path = tmp_path / "t.json"
    path.write_text(_layouts(_gpu_trace(12).to_dict())[layout])
    header = read_trace_batches(path, lambda batch: None)
    # All but the event at each buffer's edge (and the few before the first "},").
    assert header["_fast_events"] >= header["_event_count"] - 3


def test_a_run_the_types_refuse_is_read_by_the_standard_library_alike(tmp_path):
    document = _gpu_trace(3).to_dict()
    # Values the typed fields refuse but the checks accept: a float pid, a whole float count,
    # a non-object event, an event whose args is a list.
    document["traceEvents"][20]["pid"] = 4242.0
    document["traceEvents"] += [
        [1, 2],
        "x",
        {"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "args": [1]},
    ]
    nccl = next(e for e in document["traceEvents"] if str(e.get("name")).startswith("nccl"))
    nccl["args"]["In msg nelems"] = 1024.0
    path = tmp_path / "t.json"
    path.write_text(json.dumps(document))
    fast, slow = _both_paths(path)
    _same(fast, slow)
    assert any(e.pid == 4242.0 for e in fast)


@pytest.mark.parametrize("where", ["args", "unknown key"])
def test_depth_past_the_limit_is_refused_even_in_keys_the_fast_path_skips(tmp_path, where):
    document = _gpu_trace(4).to_dict()
    deep = []
    for _ in range(MAX_DEPTH):
        deep = [deep]
    event = document["traceEvents"][30]
    if where == "args":
        event["args"]["Concrete Inputs"] = deep
    else:
        event["Python frames"] = deep
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TraceFormatError, match=rf"nested deeper than {MAX_DEPTH} levels"):
        load_rank_trace(path)
    with pytest.raises(TraceFormatError, match=rf"nested deeper than {MAX_DEPTH} levels"):
        read_trace(path, lambda event: None)


def test_escaped_quotes_and_brackets_in_strings_do_not_fool_the_depth_check(tmp_path):
    document = _gpu_trace(5).to_dict()
    document["traceEvents"][25]["name"] = 'a "[[[[" \\\\" ]]]]}}}}' + "[" * 40
    path = tmp_path / "strings.json"
    path.write_text(json.dumps(document))
    fast, slow = _both_paths(path)
    _same(fast, slow)


# Strings made of what the depth check looks at: brackets, quotes and backslashes.
_tricky_strings = st.text(alphabet='[]{}"\\ ,a', max_size=8)
_nested = st.recursive(
    st.one_of(_tricky_strings, st.integers(0, 9), st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_tricky_strings, inner, max_size=3)
    ),
    max_leaves=60,
)


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


@given(values=st.lists(_nested, min_size=1, max_size=4), wrap=st.integers(0, MAX_DEPTH))
def test_the_fast_paths_depth_check_agrees_with_the_decoded_values_depth(values, wrap):
    # Unread keys of a few events, the deepest wrapped to reach around the limit; the run is
    # refused exactly where an event (one level itself) nests deeper than MAX_DEPTH.
    deepest = max(values, key=_nesting)
    for _ in range(wrap):
        deepest = [deepest]
    events = [{"ph": "X", "Python frames": v, "args": {"Ranks": str(v)}} for v in values]
    events.append({"ph": "X", "Python frames": deepest})
    run = ",".join(json.dumps(e) for e in events).encode()
    assert trace_loader._shallow(run) == (max(map(_nesting, events)) <= MAX_DEPTH)


def test_a_corrupt_byte_is_reported_with_its_offset(tmp_path):
    text = json.dumps(_gpu_trace(6).to_dict())
    at = text.index('"ts"', len(text) // 2) + 5  # the first digit of a timestamp
    broken = text[:at] + "?" + text[at + 1 :]
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(broken)
    report_dir = tmp_path
    (tmp_path / "good").mkdir()
    _gpu_trace(7).write(tmp_path / "good" / "rank1.1.pt.trace.json")
    with pytest.raises(
        TraceFormatError, match=rf"invalid JSON in traceEvents\[\d+\].* \(at byte {at}\)"
    ):
        load_rank_trace(path)
    with pytest.raises(ValueError, match=rf"rank0\.1\.pt\.trace\.json: invalid JSON.*at byte {at}"):
        analyze_run(report_dir)


def test_a_truncated_gzip_trace_is_skipped_with_the_reason(tmp_path):
    data = gzip.compress(json.dumps(_gpu_trace(8).to_dict()).encode())
    (tmp_path / "rank0.pt.trace.json.gz").write_bytes(data[: len(data) // 2])
    _gpu_trace(9).write(tmp_path / "rank1.pt.trace.json")
    report = analyze_run(tmp_path)
    [skipped] = report.skipped
    assert skipped["file"].endswith("rank0.pt.trace.json.gz") and "truncated" in skipped["reason"]


_WITHOUT_MSGSPEC = textwrap.dedent(
    """
    import json, sys
    sys.modules["msgspec"] = None  # import msgspec now fails: the standard library decodes
    from overlapkit.profiling import trace_events
    assert trace_events.batch_decoder() is None
    from overlapkit.profiling.analysis import analyze_run
    report = analyze_run(sys.argv[1], jobs=1)
    print(json.dumps([row.to_dict() for row in report.steps]))
    """
)


def test_without_msgspec_the_standard_library_gives_the_same_report(tmp_path):
    for rank in range(2):
        _gpu_trace(10 + rank).write(tmp_path / f"rank{rank}.1.pt.trace.json")
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MSGSPEC, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [row.to_dict() for row in analyze_run(tmp_path).steps]
