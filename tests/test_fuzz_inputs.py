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
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from overlapkit.cli import main as overlapkit_main
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.rank_trace import RankTrace, load_rank_trace
from overlapkit.profiling.synthetic import TraceBuilder
from overlapkit.profiling.trace_loader import TraceFormatError, read_trace
from overlapkit.topology import Topology
from overlapkit.topology.loading import PRESET_DIR, load_topology, parse_topology_yaml
from overlapkit.topology.units import parse_bandwidth, parse_duration, parse_size

FUZZ = settings(max_examples=150, deadline=None)
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


# ---- sizes, bandwidths, durations --------------------------------------------------------------


@FUZZ
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


@FUZZ
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


@FUZZ
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


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text_is_a_topology_or_an_error_naming_the_file(text):
    _topology_or_error(text)


@FUZZ
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


@FUZZ
@given(
    key=st.sampled_from([*INTEGER_KEYS, "scale_out.oversubscription"]),
    number=st.one_of(st.integers(min_value=10**309, max_value=10**400), st.integers(max_value=-1)),
)
def test_numbers_beyond_floats_or_negative_are_refused_naming_the_key(key, number):
    document = yaml.safe_load(PRESET)
    section, _, name = key.rpartition(".")
    (document[section] if section else document)[name] = number
    with pytest.raises(ValueError, match=rf"^{SOURCE}:\d+: {key}: "):
        parse_topology_yaml(yaml.safe_dump(document), source=SOURCE)


@FUZZ
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


@FUZZ
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


@FUZZ
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


@FUZZ
@given(data=st.binary(max_size=400), gz=st.booleans())
def test_trace_of_random_bytes_is_refused_naming_the_file(scratch, data, gz):
    _read_or_error(_file(scratch, ".pt.trace.json.gz" if gz else ".pt.trace.json", data))


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(VALID_TRACE) - 1), gz=st.booleans())
def test_truncated_trace_is_refused_naming_the_file(scratch, cut, gz):
    data = GZ_TRACE[: cut % len(GZ_TRACE)] if gz else VALID_TRACE[:cut]
    path = _file(scratch, ".pt.trace.json.gz" if gz else ".pt.trace.json", data)
    assert _read_or_error(path) is None


@FUZZ
@given(document=values)
def test_any_json_document_is_a_trace_or_refused(scratch, document):
    _read_or_error(_file(scratch, ".json", json.dumps(document).encode()))


@FUZZ
@given(depth=st.integers(min_value=3000, max_value=100000))
def test_deeply_nested_trace_json_is_refused(scratch, depth):
    data = b'{"traceEvents": [' + b"[" * depth + b"]" * depth + b"]}"
    assert _read_or_error(_file(scratch, ".json", data)) is None


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


@FUZZ
@given(events=st.lists(st.one_of(event_fields, values), max_size=8), info=values)
def test_trace_with_malformed_events_is_analysed_or_refused_naming_the_file(scratch, events, info):
    document = _valid_trace()
    document["traceEvents"] += events
    document["distributedInfo"] = info
    path = _file(scratch, ".pt.trace.json", json.dumps(document).encode())
    try:
        assert isinstance(load_rank_trace(path), RankTrace)
    except TraceFormatError as err:
        assert str(err).startswith(str(path)), err


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


@FUZZ
@given(size=st.text(max_size=20), bandwidth=st.text(max_size=20))
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


@FUZZ
@given(name=st.text(max_size=30))
def test_topo_and_plan_commands_with_random_topology_names_exit_cleanly(name):
    for argv in (("topo", f"--preset={name}"), ("plan", f"--topology={name}", "--tp", "2")):
        code, err = _cli(*argv)
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert "error:" in err, err


@FUZZ
@given(data=st.binary(max_size=300))
def test_topo_command_with_a_random_file_exits_cleanly_naming_it(scratch, data):
    path = _file(scratch, ".yaml", data)
    code, err = _cli("topo", "--file", str(path))
    assert code in (0, 2), (code, err)
    if code == 2:
        assert str(path) in err, err


@FUZZ
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
