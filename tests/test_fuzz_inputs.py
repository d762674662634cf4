"""Untrusted inputs (topology YAML, profiler traces, sizes on the command line), fuzzed.

Every malformed input must end in the project's own error (``ValueError`` or its subclass
``TraceFormatError``, ``FileNotFoundError``) naming the file or option, or in an argparse usage
error; never in an internal traceback (``KeyError``, ``AttributeError``, ``OverflowError``,
``RecursionError`` from deep inside), a hang, or code run from the file.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from bench.harness.synthetic_traces import TraceBuilder
from overlapkit.cli import main as overlapkit_main
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.rank_trace import RankTrace, load_rank_trace
from overlapkit.profiling.trace_loader import MAX_DEPTH, TraceFormatError, read_trace
from overlapkit.topology import Topology
from overlapkit.topology.loading import PRESET_DIR, load_topology, parse_topology_yaml
from overlapkit.topology.units import parse_bandwidth, parse_duration, parse_size
from tests.conftest import CI_EXAMPLES, PROFILE_ENV

SOURCE = "fuzz.yaml"
PRESET = (PRESET_DIR / "dgx-h100.yaml").read_text()
_files = itertools.count()

# YAML/JSON scalars as a hostile file would write them: huge and non-finite numbers included.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**18, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _file(scratch: Path, suffix: str, data: bytes) -> Path:
    path = scratch / f"f{next(_files)}{suffix}"
    path.write_bytes(data)
    return path


def _drawn(strategy: st.SearchStrategy) -> list:
    seen: list = []

    @given(strategy)
    def draw(value):
        seen.append(value)

    draw()
    return seen


@pytest.mark.skipif(
    os.environ.get(PROFILE_ENV, "ci") != "ci", reason="the fuzz profile draws anew each run"
)
def test_property_tests_draw_the_same_examples_on_every_run():
    first = _drawn(st.integers())
    assert len(first) == CI_EXAMPLES and first == _drawn(st.integers())


# ---- sizes, bandwidths, durations --------------------------------------------------------------


@given(
    text=st.one_of(
        st.text(max_size=30),
        st.from_regex(
            r"\s*[-+]?[0-9.eE+-]{1,12}\s*[kKmMgGtTpP]?i?[bB]?(it)?(/s|ps)?\s*", fullmatch=True
        ),
    )
)
def test_size_and_bandwidth_parsers_return_a_finite_number_or_name_the_value(text):
    for parse, what in ((parse_size, "--bytes"), (parse_bandwidth, "--bandwidth")):
        try:
            value = parse(text, what=what)
        except ValueError as err:
            assert what in str(err) and repr(text) in str(err), err
        else:
            assert math.isfinite(value) and value >= 0, (text, value)


@given(
    text=st.one_of(
        st.text(max_size=30),
        st.from_regex(r"[-+]?[0-9.eE+-]{1,12}(s|ms|us|µs|ns)?", fullmatch=True),
    )
)
def test_duration_parser_returns_a_finite_number_or_names_the_value(text):
    try:
        value = parse_duration(text, what="--latency")
    except ValueError as err:
        assert "--latency" in str(err) and repr(text) in str(err), err
    else:
        assert math.isfinite(value) and value >= 0, (text, value)


@given(number=st.one_of(st.integers(min_value=-(10**400), max_value=10**400), st.floats()))
def test_numeric_sizes_are_finite_or_refused(number):
    for parse in (parse_size, parse_bandwidth, parse_duration):
        try:
            value = parse(number, what="x")
        except (ValueError, OverflowError) as err:
            assert not isinstance(err, OverflowError), (parse, number)
        else:
            assert math.isfinite(value), (parse, number, value)


# ---- topology YAML ------------------------------------------------------------------------------


def _topology_or_error(text: str) -> Topology | None:
    try:
        topology = parse_topology_yaml(text, source=SOURCE)
    except ValueError as err:
        assert str(err).startswith(SOURCE), err
        return None
    assert isinstance(topology, Topology)
    return topology


@given(text=st.text(max_size=300))
# Values PyYAML resolves to a type whose constructor then raises a bare ValueError (issue 17).
@example(text="name: 2001-13-01\n")
@example(text="name: !!int 0o99\n")
@example(text="nodes: " + "9" * 5000 + "\n")
def test_random_text_is_a_topology_or_an_error_naming_the_file(text):
    _topology_or_error(text)


@given(data=st.data())
def test_a_preset_with_one_key_replaced_by_a_random_value_is_valid_or_refused(data):
    document = yaml.safe_load(PRESET)
    section = data.draw(st.sampled_from([None, "scale_up", "scale_out"]))
    target = document if section is None else document[section]
    key = data.draw(st.sampled_from([*sorted(target), "unknown_key"]))
    target[key] = data.draw(values)
    _topology_or_error(yaml.safe_dump(document))


INTEGER_KEYS = [
    "nodes",
    "devices_per_node",
    "scale_up.links",
    "scale_up.nodes_per_domain",
    "scale_out.nics_per_node",
    "scale_out.nodes_per_leaf",
]


@given(
    key=st.sampled_from([*INTEGER_KEYS, "scale_out.oversubscription"]),
    number=st.one_of(st.integers(min_value=10**309, max_value=10**400), st.integers(max_value=-1)),
)
@example(key="scale_out.oversubscription", number=math.inf)  # was accepted (issue 17)
def test_numbers_beyond_floats_or_negative_are_refused_naming_the_key(key, number):
    document = yaml.safe_load(PRESET)
    section, _, name = key.rpartition(".")
    (document[section] if section else document)[name] = number
    with pytest.raises(ValueError, match=rf"^{SOURCE}:\d+: {key}: "):
        parse_topology_yaml(yaml.safe_dump(document), source=SOURCE)


@given(key=st.sampled_from(INTEGER_KEYS), number=st.integers(min_value=2**31, max_value=2**70))
def test_counts_beyond_any_machine_are_refused_naming_the_key(key, number):
    document = yaml.safe_load(PRESET)
    section, _, name = key.rpartition(".")
    (document[section] if section else document)[name] = number
    with pytest.raises(ValueError, match=rf"^{SOURCE}:\d+: {key}: must be <= "):
        parse_topology_yaml(yaml.safe_dump(document), source=SOURCE)


@pytest.mark.parametrize("nodes", ["9" * 400, "10000000", "1e400", ".inf"])
def test_a_preset_with_absurd_node_count_is_refused(nodes):
    with pytest.raises(ValueError, match=rf"{SOURCE}:\d+: nodes"):
        parse_topology_yaml(PRESET.replace("nodes: 1\n", f"nodes: {nodes}\n"), source=SOURCE)


def test_multi_node_preset_name_with_absurd_count_is_refused():
    with pytest.raises(ValueError, match=r"nodes: 99999999999 nodes x 8 devices_per_node"):
        load_topology("dgx-h100x99999999999")
    with pytest.raises(ValueError, match=r"dgx-h100x<N>: N has 5000 digits; at most 262144 ranks"):
        load_topology("dgx-h100x" + "9" * 5000)


@given(depth=st.integers(min_value=50, max_value=20000), bracket=st.sampled_from(["[", "{a: "]))
def test_deeply_nested_yaml_is_refused(depth, bracket):
    closing = "]" if bracket == "[" else "}"
    _topology_or_error(f"scale_up: {bracket * depth}1{closing * depth}\n")


@pytest.mark.timeout(30)
def test_alias_bomb_and_self_reference_are_refused_without_expanding():
    # Nine levels of ten aliases each: 10**9 paths if the aliases were walked as a tree.
    bomb = "a: &a {x0: 1, x1: 1, x2: 1, x3: 1, x4: 1, x5: 1, x6: 1, x7: 1, x8: 1, x9: 1}\n"
    for level in range(8):
        name, previous = chr(ord("b") + level), chr(ord("a") + level)
        fields = ", ".join(f"k{i}: *{previous}" for i in range(10))
        bomb += f"{name}: &{name} {{{fields}}}\n"
    assert _topology_or_error(bomb) is None
    assert _topology_or_error("scale_up: &s {kind: nvlink, loop: *s}\n") is None


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:builtins.print ['ran']",
        "!!python/object/new:builtins.open ['ran', 'w']",
        "!!python/name:os.system",
        "!!python/module:os",
        "!!binary 'AAAA'",
        "!<tag:yaml.org,2002:python/object:pathlib.Path> {}",
    ],
)
def test_yaml_tags_that_build_objects_are_refused(tag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _topology_or_error(f"name: {tag}\n") is None
    assert _topology_or_error(f"{tag}\n") is None
    assert not (tmp_path / "ran").exists()


@given(data=st.binary(max_size=300))
def test_topology_file_of_random_bytes_is_refused_naming_the_file(scratch, data):
    path = _file(scratch, ".yaml", data)
    try:
        load_topology(path)
    except ValueError as err:
        assert str(path) in str(err), err


# ---- profiler traces ----------------------------------------------------------------------


def _read_or_error(path: Path) -> dict | None:
    try:
        return read_trace(path, lambda event: None)
    except TraceFormatError as err:
        assert str(err).startswith(str(path)), err
        return None


def _valid_trace() -> dict:
    t = TraceBuilder(rank=0, world_size=2, backend="gloo")
    for step in range(3):
        base = step * 100.0
        t.step(step + 1, base, base + 90)
        t.cpu_op("aten::mm", base + 5, base + 60)
        t.gloo("allreduce", base + 30, base + 80, nelems=1024)
    return t.to_dict()


VALID_TRACE = json.dumps(_valid_trace()).encode()
GZ_TRACE = gzip.compress(VALID_TRACE)


@given(data=st.binary(max_size=400), gz=st.booleans())
def test_trace_of_random_bytes_is_refused_naming_the_file(scratch, data, gz):
    _read_or_error(_file(scratch, ".pt.trace.json.gz" if gz else ".pt.trace.json", data))


@given(cut=st.integers(min_value=0, max_value=len(VALID_TRACE) - 1), gz=st.booleans())
def test_truncated_trace_is_refused_naming_the_file(scratch, cut, gz):
    data = GZ_TRACE[: cut % len(GZ_TRACE)] if gz else VALID_TRACE[:cut]
    path = _file(scratch, ".pt.trace.json.gz" if gz else ".pt.trace.json", data)
    assert _read_or_error(path) is None


@given(document=values)
def test_any_json_document_is_a_trace_or_refused(scratch, document):
    _read_or_error(_file(scratch, ".json", json.dumps(document).encode()))


@given(depth=st.integers(min_value=3000, max_value=100000))
def test_deeply_nested_trace_json_is_refused(scratch, depth):
    data = b'{"traceEvents": [' + b"[" * depth + b"]" * depth + b"]}"
    assert _read_or_error(_file(scratch, ".json", data)) is None


@pytest.mark.parametrize("where", ["event", "top-level value"])
def test_trace_nesting_limit_is_the_readers_own_not_the_interpreters(tmp_path, where):
    # MAX_DEPTH + 1 levels is far below any interpreter's recursion limit, so the refusal can
    # only come from the reader's own check; MAX_DEPTH levels still read.
    def document(depth: int) -> bytes:
        nested = b"[" * depth + b"]" * depth
        if where == "event":
            return b'{"traceEvents": [' + nested + b"]}"
        return b'{"traceEvents": [], "deviceProperties": ' + nested + b"}"

    path = tmp_path / "deep.pt.trace.json"
    path.write_bytes(document(MAX_DEPTH))
    assert read_trace(path, lambda event: None)["_event_count"] == (where == "event")
    path.write_bytes(document(MAX_DEPTH + 1))
    with pytest.raises(TraceFormatError, match=rf"nested deeper than {MAX_DEPTH} levels"):
        read_trace(path, lambda event: None)


event_fields = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.one_of(st.just("X"), scalars),
        "cat": st.one_of(
            st.sampled_from(["cpu_op", "kernel", "user_annotation", "cuda_runtime"]), scalars
        ),
        "name": st.one_of(
            st.sampled_from(
                [
                    "ProfilerStep#1",
                    "gloo:all_reduce",
                    "ncclKernel",
                    "record_param_comms",
                    "aten::mm",
                ]
            ),
            scalars,
        ),
        "ts": st.one_of(st.floats(0, 1000), scalars),
        "dur": st.one_of(st.floats(0, 100), scalars),
        "pid": scalars,
        "tid": scalars,
        "args": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "Input Dims": values,
                    "Input type": values,
                    "In msg nelems": scalars,
                    "dtype": scalars,
                    "Collective name": scalars,
                    "correlation": scalars,
                    "External id": scalars,
                },
            ),
            values,
        ),
    },
)


@given(events=st.lists(st.one_of(event_fields, values), max_size=8), info=values)
# Found by exploration (issue 17): a ts beyond the float range crashed with OverflowError.
@example(
    events=[
        {
            "ph": "X",
            "args": {},
            "tid": None,
            "pid": None,
            "cat": "cpu_op",
            "ts": 190_270_053_104_187_226_769 * 10**300,
        }
    ],
    info=None,
)
# Found in the same way: a "dur" beyond the float range on a step range.
@example(
    events=[
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "ProfilerStep#1",
            "ts": 90390,
            "dur": 7_304_789_029_888_051_084 * 10**300,
            "args": {},
        }
    ],
    info=[],
)
def test_trace_with_malformed_events_is_analysed_or_refused_naming_the_file(scratch, events, info):
    document = _valid_trace()
    document["traceEvents"] += events
    document["distributedInfo"] = info
    path = _file(scratch, ".pt.trace.json", json.dumps(document).encode())
    try:
        assert isinstance(load_rank_trace(path), RankTrace)
    except TraceFormatError as err:
        assert str(err).startswith(str(path)), err


HUGE = 10**400  # an int JSON allows and float() cannot hold
GLOO = {"name": "gloo:all_reduce"}  # a range whose "Input Dims" the reader sizes


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"ts": HUGE}, '"ts" is 100000000000000000000000... (401 characters); expected a finite'),
        ({"ts": -HUGE}, '"ts" is -10000000000000000000000... (402 characters)'),
        ({"ts": math.nan}, '"ts" is nan; expected a finite number of µs'),
        ({"ts": "12.5"}, "\"ts\" is '12.5'; expected a finite number of µs"),
        ({"ts": True}, '"ts" is True'),
        ({"dur": HUGE}, '"dur" is 1000'),
        ({"dur": -math.inf}, '"dur" is -inf'),
        ({"ts": 1e308, "dur": 1e308}, '"ts" + "dur" is inf'),
        ({"pid": [1]}, '"pid" is [1]; expected a number or a string'),
        ({"tid": {"a": 1}}, "\"tid\" is {'a': 1}"),
        ({"name": "ProfilerStep#" + "9" * 5000}, "step number '9999"),
        (
            {**GLOO, "args": {"Input Dims": [[HUGE]], "Input type": ["float"]}},
            '"Input Dims"[0] is 1000',
        ),
        (
            {**GLOO, "args": {"Input Dims": [[2**62, 4]], "Input type": ["float"]}},
            '"Input Dims"[0] gives 3.689e+19 bytes; more than any tensor holds',
        ),
        (
            {**GLOO, "args": {"Input Dims": [[1.5]], "Input type": ["float"]}},
            '"Input Dims"[0] is 1.5; expected a whole number in [0, 2**63)',
        ),
        (
            {**GLOO, "args": {"Input Dims": [7], "Input type": ["float"]}},
            '"Input Dims"[0] is 7; expected the list of a tensor\'s sizes',
        ),
        ({"args": {"In msg nelems": math.inf, "dtype": "float"}}, '"In msg nelems" is inf'),
        ({"args": {"In msg nelems": -1}}, '"In msg nelems" is -1'),
        ({"args": {"External id": [2]}}, '"External id" is [2]'),
        ({"cat": "kernel", "args": {"correlation": {}}}, '"correlation" is {}'),
        ({"cat": "cuda_runtime", "args": {"correlation": [3]}}, '"correlation" is [3]'),
    ],
)
def test_out_of_range_numbers_and_ids_in_an_event_are_refused_naming_file_event_and_field(
    tmp_path, fields, refused
):
    document = _valid_trace()
    index = len(document["traceEvents"])
    event = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 5.0, "dur": 1.0}
    document["traceEvents"].append({**event, "pid": 4242, "tid": 4242, **fields})
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps(document))
    name = repr(fields.get("name", event["name"]))[:24]
    with pytest.raises(TraceFormatError) as refusal:
        load_rank_trace(path)
    assert str(refusal.value).startswith(f"{path}: traceEvents[{index}]: {name}"), refusal.value
    assert f": {refused}" in str(refusal.value), refusal.value
    code, err = _cli("report", str(tmp_path))
    assert code == 2 and f"traceEvents[{index}]: {name}" in err, err


@pytest.mark.parametrize(
    "info",
    [{"rank": 10**40}, {"rank": -1}, {"rank": 0, "world_size": 0}, {"rank": 0, "world_size": HUGE}],
)
def test_out_of_range_rank_or_world_size_is_refused_naming_the_file(tmp_path, info):
    document = {**_valid_trace(), "distributedInfo": info}
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps(document))
    with pytest.raises(
        TraceFormatError, match=rf"^{re.escape(str(path))}: distributedInfo has rank"
    ):
        load_rank_trace(path)


def test_an_integer_literal_longer_than_python_reads_is_refused_naming_the_file(tmp_path):
    for where, data in (
        ("traceEvents[0]", '{"traceEvents": [{"ph": "X", "ts": ' + "9" * 5000 + "}]}"),
        ("top-level key 'x'", '{"traceEvents": [], "x": ' + "9" * 5000 + "}"),
    ):
        path = tmp_path / "long.pt.trace.json"
        path.write_text(data)
        with pytest.raises(
            TraceFormatError,
            match=rf"long\.pt\.trace\.json: {re.escape(where)} holds an integer with too many",
        ):
            read_trace(path, lambda event: None)


# ---- the overlapkit command, in process --------------------------------------------------


def _cli(*argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``overlapkit ARGV``; argparse's usage errors count as exit 2."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = overlapkit_main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


@given(size=st.text(max_size=20), bandwidth=st.text(max_size=20))
# Found by make fuzz (issue 17): an empty --bandwidth fell through to "unknown topology preset
# 'None'".
@example(size="0", bandwidth="")
def test_estimate_command_with_random_sizes_exits_cleanly(size, bandwidth):
    code, err = _cli(
        "estimate",
        "--collective",
        "all_reduce",
        f"--bytes={size}",
        f"--bandwidth={bandwidth}",
        "--group-size",
        "8",
    )
    assert code in (0, 2), (code, err)
    if code == 2:
        assert "error:" in err and ("--bytes" in err or "--bandwidth" in err), err


@given(name=st.text(max_size=30))
def test_topo_and_plan_commands_with_random_topology_names_exit_cleanly(name):
    for argv in (("topo", f"--preset={name}"), ("plan", f"--topology={name}", "--tp", "2")):
        code, err = _cli(*argv)
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert "error:" in err, err


@given(data=st.binary(max_size=300))
def test_topo_command_with_a_random_file_exits_cleanly_naming_it(scratch, data):
    path = _file(scratch, ".yaml", data)
    code, err = _cli("topo", "--file", str(path))
    assert code in (0, 2), (code, err)
    if code == 2:
        assert str(path) in err, err


@given(data=st.binary(max_size=300))
def test_report_command_with_a_random_trace_exits_cleanly_naming_it(scratch, data):
    run_dir = scratch / f"run{next(_files)}"
    run_dir.mkdir()
    path = _file(run_dir, ".pt.trace.json", data)
    code, err = _cli("report", str(run_dir))
    assert code in (0, 2), (code, err)
    if code == 2:
        assert path.name in err, err


def test_analyze_run_reports_a_malformed_trace_as_skipped(tmp_path):
    (tmp_path / "rank0.pt.trace.json").write_bytes(VALID_TRACE)
    (tmp_path / "rank1.pt.trace.json").write_bytes(VALID_TRACE[: len(VALID_TRACE) // 2])
    report = analyze_run(tmp_path)
    assert [Path(f).name for f in report.files] == ["rank0.pt.trace.json"]
    assert report.skipped[0]["reason"].startswith("file ends early")
