"""Typed records: one writer, one reader, round trips, and records of older versions."""

from __future__ import annotations

import json

from dcp_fsdp.telemetry import records
from dcp_fsdp.telemetry.records import InitRow, ModelInfo, RunRecord, Sample


def _sample(rank: int, **extra) -> Sample:
    return Sample(op="save", iteration=1, suffix="s", rank=rank, host="h", begin_wall_s=1.0,
                  end_wall_s=2.0, begin_mono_s=10.0, end_mono_s=11.0, duration_s=1.0,
                  bytes=100, barrier_wait_s=0.01, plan_s=0.1, io_s=0.8, commit_s=0.1, **extra)


def test_round_trip_keeps_every_field(tmp_path):
    run = RunRecord(run_id="r1", command="save", status="ok", world_size=2,
                    init=[InitRow(rank=0, init_s=1.5), InitRow(rank=1, init_s=1.6)],
                    model=ModelInfo(preset="tiny_llama"), suffixes=["s"])
    samples = [_sample(0, blocked_s=0.2), _sample(1)]
    path = records.write_records(records.record_path(str(tmp_path), "r1"), run, samples)
    assert path.name == "r1.jsonl" and not path.with_suffix(".jsonl.tmp").exists()
    read = records.read_record_file(path)
    assert read.bad_lines == 0 and len(read.runs) == 1
    assert read.runs[0] == run
    assert [s.model_copy(update={"run_id": None}) for s in read.samples] == samples
    assert all(s.run_id == "r1" for s in read.samples)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["record"] == "run" and first["schema_version"] == records.SCHEMA_VERSION


def test_older_records_read_with_defaults_and_newer_fields_are_ignored(tmp_path):
    path = tmp_path / "old.jsonl"
    run_line = {"record": "run", "schema_version": 1, "run_id": "old", "command": "load",
                "status": "ok", "init": [{"rank": 0, "init_s": 2.0, "a_future_field": 1}]}
    sample = _sample(0).model_dump()
    for newer in ("blocked_s", "peak_rss_bytes", "fetched_bytes", "run_id"):
        sample.pop(newer)
    lines = [run_line, {"record": "sample", "run_id": "old", **sample, "from_the_future": 3}]
    path.write_text("\n".join(json.dumps(line) for line in lines)
                    + '\n{"record": "sample", "run_id": "ol\nnot json\n')  # cut off; a stray line
    read = records.read_record_file(path)
    assert read.bad_lines == 1 and read.unknown_lines == 1
    assert read.runs[0].schema_version == 1 and read.runs[0].init[0].init_s == 2.0
    assert read.samples[0].blocked_s is None and read.samples[0].bytes == 100


def test_a_record_without_schema_version_reads_as_zero(tmp_path):
    path = tmp_path / "v0.jsonl"
    path.write_text(json.dumps({"record": "run", "run_id": "x", "command": "save"}) + "\n")
    assert records.read_record_file(path).runs[0].schema_version == 0


def test_urls_lose_their_credentials():
    assert records.redact_url("http://user:pw@host:9000/x") == "http://host:9000/x"
    assert records.redact_url("http://host:9000") == "http://host:9000"
    assert records.redact_url(None) is None


def test_the_suites_records_read_whole_and_write_back_as_they_were(tmp_path):
    """Every record the test data holds passes the models, and a run and its samples
    written again give the same JSON values (names, nesting, nulls) as the file held (with
    the top-level fields of later versions added, as null: the run's and its init rows')."""
    from pathlib import Path

    for path in sorted((Path(__file__).parent / "data").glob("*.jsonl")):
        read = records.read_record_file(path)
        assert read.skipped == [] and read.runs and read.samples, path
        copy = records.write_records(tmp_path / path.name, read.runs[0], read.samples)
        for again, held in zip(copy.read_text().splitlines(), path.read_text().splitlines()):
            written, original = json.loads(again), json.loads(held)
            written["init"] = [{key: row[key] for key in was}  # init rows: top-level too
                               for row, was in zip(written.get("init", []), original.get("init", []))]
            assert {key: written[key] for key in original} == original, path
