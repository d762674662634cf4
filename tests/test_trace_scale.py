"""The analysis at scale gives the same numbers: on worker processes, with its records spilled
to disk, and summarised for many ranks (top slowest ranks per step, per rank percentiles)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench.harness.synthetic_run import Injection, RunSpec, write_run
from overlapkit.profiling import cli, record_store
from overlapkit.profiling.analysis import analyze_file, analyze_files, analyze_run
from overlapkit.profiling.stragglers import find_stragglers

SLOW = (Injection(rank=5, step=3, position=0, cause="compute", delay_ms=4.0),)


@pytest.fixture(scope="module")
def run64(tmp_path_factory):
    """64 ranks x 12 steps on 8 hosts, one slow rank in step 3."""
    directory = tmp_path_factory.mktemp("run64")
    spec = RunSpec(
        ranks=64,
        steps=12,
        collectives_per_step=1,
        ops_per_segment=2,
        ranks_per_host=8,
        clock_offset_s=1.5,
        injections=SLOW,
    )
    return directory, write_run(spec, directory)


def _numbers(report):
    return report.table.tolist(), report.kind_table.tolist()


def test_worker_processes_give_the_numbers_of_one_process(run64):
    directory, _ = run64
    serial = analyze_run(directory, jobs=1)
    parallel = analyze_run(directory, jobs=2, min_bytes=0)
    assert _numbers(parallel) == _numbers(serial)
    assert [t["file"] for t in parallel.traces] == [t["file"] for t in serial.traces]


def test_records_spilled_to_disk_give_the_numbers_of_records_in_memory(tmp_path, monkeypatch):
    spec = RunSpec(
        ranks=2,
        steps=40,
        collectives_per_step=3,
        ops_per_segment=3,
        blocking=False,
        injections=(Injection(rank=1, step=9, position=1, cause="host_gap", delay_ms=2.0),),
    )
    write_run(spec, tmp_path)
    path = tmp_path / "rank1.1.pt.trace.json"
    kept = analyze_file(path, program=True)
    monkeypatch.setattr(record_store, "BLOCK_ROWS", 64)
    spilled = analyze_file(path, program=True, budget_bytes=4096)
    assert spilled.steps.tolist() == kept.steps.tolist()
    assert spilled.kinds.tolist() == kept.kinds.tolist()
    assert spilled.program.rows.tobytes() == kept.program.rows.tobytes()
    files = [tmp_path / f"rank{r}.1.pt.trace.json" for r in range(2)]
    whole = find_stragglers(analyze_files(files, tmp_path, jobs=1, programs=True).programs)
    small = find_stragglers(
        analyze_files(files, tmp_path, jobs=1, programs=True, budget_bytes=4096).programs
    )
    assert [s.to_dict() for s in small.stragglers] == [s.to_dict() for s in whole.stragglers]
    assert [(s.rank, s.step, s.cause) for s in whole.stragglers] == [(1, 9, "host_gap")]


def test_the_spilled_store_really_writes_blocks_to_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(record_store, "BLOCK_ROWS", 8)
    store = record_store.SpillStore(budget_bytes=200)
    table = record_store.RecordTable(
        np.dtype([("start", "f8"), ("end", "f8")]), ("start", "end"), store
    )
    rows = np.zeros(100, table.dtype)
    rows["start"] = np.arange(100)
    rows["end"] = rows["start"] + 0.5
    for k in range(0, 100, 10):
        table.append(rows[k : k + 10])
    table.flush()
    assert store.spilled_bytes > 0 and any(b.rows is None for b in table.blocks)
    assert table.select("start", 20, 30)["start"].tolist() == list(range(20, 30))
    assert table.overlapping(49.2, 50.1)["start"].tolist() == [49.0, 50.0]
    store.close()


def _report(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_64_ranks_are_summarised_with_the_top_5_slowest_per_step_and_percentiles(run64, capsys):
    directory, _ = run64
    payload = json.loads(
        _report(
            [
                "report",
                str(directory),
                "--json",
                "--step-rows",
                "0",
                "--jobs",
                "1",
                "--stragglers",
                "--collective-rows",
                "2",
            ],
            capsys,
        )
    )
    assert payload["steps"] == [] and payload["steps_omitted"] == 64 * 12
    step3 = next(s for s in payload["slowest_ranks"] if s["step"] == 3)
    assert len(step3["ranks"]) == 5
    report = analyze_run(directory, jobs=1)
    rows = report.table[report.table["step"] == 3]
    top = rows[np.argsort(-rows["step_ms"], kind="stable")[:5]]
    assert [r["rank"] for r in step3["ranks"]] == top["rank"].tolist()
    percentiles = {r["rank"]: r for r in payload["rank_percentiles"]}
    mine = report.table[report.table["rank"] == 5]["step_ms"]
    assert percentiles[5]["step_ms_p50"] == pytest.approx(np.percentile(mine, 50))
    assert percentiles[5]["step_ms_p99"] == pytest.approx(np.percentile(mine, 99))
    [first] = payload["stragglers"]
    assert (first["rank"], first["step"], first["cause"]) == (5, 3, "compute")
    assert len(payload["collectives"]) == 2 and payload["collectives_omitted"] == 10
    offsets = {o["rank"]: o["offset_us"] for o in payload["clock"]["offsets_us"]}
    assert len({offsets[r] for r in range(8)}) == 1  # one host, one clock
    text = _report(["report", str(directory), "--step-rows", "3", "--jobs", "1"], capsys)
    assert f"{64 * 12 - 3} more rows (--step-rows)" in text
    assert "the 10 of 64 ranks" in text
