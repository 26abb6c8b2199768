"""`dcp-fsdp report` on bad input: every file and line that cannot be read is skipped with
its reason (one note per reason), the rest still reports, and a copy changes no figure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from dcp_fsdp.analysis import report
from dcp_fsdp.analysis.sources import EXAMPLES_PER_NOTE
from dcp_fsdp.telemetry.records import SCHEMA_VERSION, read_record_file
from tests.unit.analysis_kit import ONE_ITERATION, cut_last_line, lines


def write_record(path: Path, change: Callable[[list[dict[str, Any]]], None] | None = None,
                 run_id: str | None = None) -> Path:
    """The real one-iteration record, as `run_id`, with its rows passed through `change`."""
    rows = lines(ONE_ITERATION)
    for row in rows:
        row["run_id"] = run_id or row["run_id"]
    if change:
        change(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read(*paths: Path) -> tuple[dict[str, Any], list[str]]:
    runs, samples, notes = report.read_records(report.record_files([str(p) for p in paths]))
    return report.build(runs, samples), notes


def run_report(capsys, *args: str) -> tuple[int, str, str]:
    code = report.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def aggregate_mib_s(result: dict[str, Any]) -> dict[str, float]:
    table = result["throughput"]
    return dict(zip(table["op"], table["aggregate_mib_s"]))


@pytest.mark.parametrize("run_line", [{"record": "run"},
                                      {"record": "run", "run_id": "x", "command": ["save"]}])
def test_a_foreign_run_line_alone_is_one_clear_line_and_exit_2(tmp_path, capsys, run_line):
    path = tmp_path / "foreign.jsonl"
    path.write_text(json.dumps(run_line) + "\n")
    code, out, err = run_report(capsys, str(path))
    assert code == 2 and "Traceback" not in err
    assert "no dcp-fsdp records among 1 file(s)" in err
    assert "1 file(s) skipped, run line: " in err and str(path) in err


def test_a_foreign_file_beside_a_record_is_skipped_and_the_record_reports(tmp_path, capsys):
    write_record(tmp_path / "good.jsonl")
    (tmp_path / "foreign.jsonl").write_text('{"record": "run"}\n{"record": "sample"}\n')
    code, out, _ = run_report(capsys, str(tmp_path))
    assert code == 0 and "Throughput" in out
    flat = "".join(out.split())  # the table wraps long paths at the terminal's width
    assert "1file(s)skipped,runline:norun_id:" in flat and "foreign.jsonl" in flat


def test_a_schema_version_that_is_not_an_integer_skips_the_file_with_the_reason(tmp_path,
                                                                                capsys):
    path = write_record(tmp_path / "r.jsonl", lambda rows: rows[0].update(schema_version="two"))
    code, _, err = run_report(capsys, str(path))
    assert code == 2 and "Traceback" not in err
    assert "run line: schema_version is not an integer" in err


@pytest.mark.parametrize("field, value, reason", [
    ("rank", "x", "rank is not an integer"),
    ("bytes", "lots", "bytes is not an integer"),
    ("duration_s", float("nan"), "duration_s is not a finite number"),
    ("bytes", -5, "bytes is negative"),
    ("end_wall_s", 0.0, "end_wall_s before begin_wall_s"),
])
def test_a_bad_sample_line_is_skipped_and_its_run_left_out(tmp_path, capsys, field, value,
                                                           reason):
    write_record(tmp_path / "bad.jsonl", lambda rows: rows[1].update({field: value}),
                 run_id="bad")
    write_record(tmp_path / "good.jsonl", run_id="good")
    result, notes = read(tmp_path)
    assert set(result["operations"]["run_id"]) == {"good"}  # the bad run's figures: none
    assert result["not_ok"].set_index("run_id").loc["bad", "status"] == "incomplete"
    assert notes == [f"1 line(s) skipped, sample line: {reason}: {tmp_path / 'bad.jsonl'}:2"]
    code, out, err = run_report(capsys, str(tmp_path))
    assert code == 0 and "Traceback" not in err and reason in out


def test_negative_bytes_never_reach_a_figure(tmp_path):
    def negative(rows):
        for row in rows[1:]:
            row["bytes"] = -row["bytes"]

    write_record(tmp_path / "r.jsonl", negative)
    result, notes = read(tmp_path)
    assert result["throughput"].empty  # not agg -28.8 MiB/s
    (note,) = notes
    assert note.startswith("4 line(s) skipped, sample line: bytes is negative:")


def test_a_copy_in_a_subdirectory_changes_no_figure_and_is_named(tmp_path):
    alone = write_record(tmp_path / "alone" / "r.jsonl")
    single, _ = read(alone.parent)
    copies = tmp_path / "copies"
    write_record(copies / "r.jsonl")
    write_record(copies / "backup" / "r.jsonl")
    result, notes = read(copies)
    assert aggregate_mib_s(result) == aggregate_mib_s(single)
    assert list(result["throughput"]["runs"]) == [1, 1]
    assert len(result["runs"]) == 1 and len(result["samples"]) == len(single["samples"])
    (note,) = notes
    assert note.startswith("1 duplicate record(s) skipped") and "backup" in note


def test_of_two_copies_the_whole_one_is_kept(tmp_path):
    write_record(tmp_path / "a" / "r.jsonl")
    cut_last_line(write_record(tmp_path / "b" / "r.jsonl"))
    cut_last_line(write_record(tmp_path / "0" / "r.jsonl"))  # read first, cut off
    result, notes = read(tmp_path)
    assert result["not_ok"].empty and len(result["throughput"]) == 2
    assert result["runs"]["run_id"].size == 1
    assert any("2 duplicate record(s)" in note for note in notes)


def test_a_record_newer_than_the_reader_is_read_with_one_note(tmp_path):
    newer = SCHEMA_VERSION + 1

    def from_the_future(rows):
        for row in rows:
            row["a_future_field"] = 1
        rows[0]["schema_version"] = newer

    write_record(tmp_path / "r.jsonl", from_the_future)
    result, notes = read(tmp_path)
    assert len(result["throughput"]) == 2
    (note,) = notes
    assert f"schema_version {newer}, newer than this reader's {SCHEMA_VERSION}" in note


def test_a_record_file_named_json_given_by_name_is_read(tmp_path, capsys):
    path = tmp_path / "r.json"
    shutil.copy(ONE_ITERATION, path)
    code, out, err = run_report(capsys, str(path))
    assert code == 0 and "Throughput" in out, err
    (tmp_path / "tune.json").write_text('{"trials": []}')
    assert report.record_files([str(tmp_path)]) == []  # a directory: *.jsonl only
    code, _, err = run_report(capsys, str(tmp_path / "tune.json"))
    assert code == 2 and "no run line: not a dcp-fsdp record" in err


def test_many_bad_lines_make_one_note_per_reason(tmp_path):
    def damaged(rows):
        rows.extend([{**rows[1], "rank": "x"}] * 500 + [{**rows[1], "bytes": -1}] * 500
                    + [{"record": "event"}] * 3)

    write_record(tmp_path / "r.jsonl", damaged)
    _, notes = read(tmp_path)
    assert len(notes) == 3
    rank, negative, kind = notes
    assert rank.startswith("500 line(s) skipped, sample line: rank is not an integer:")
    assert rank.endswith(f"+{500 - EXAMPLES_PER_NOTE} more")
    assert negative.startswith("500 line(s) skipped, sample line: bytes is negative")
    assert kind.startswith("3 line(s) skipped, not a run or sample line")


def test_a_file_named_twice_is_read_once(tmp_path):
    path = write_record(tmp_path / "r.jsonl")
    assert report.record_files([str(path), str(tmp_path), str(tmp_path / "*.jsonl")]) == [path]


def test_sample_checks_allow_signed_ratios_and_reject_bools(tmp_path):
    row = {"record": "sample", "op": "save", "iteration": 1, "suffix": "s", "rank": 0,
           "host": "h", "begin_wall_s": 1.0, "end_wall_s": 2.0, "begin_mono_s": 1,
           "end_mono_s": 2, "duration_s": 1.0, "bytes": 10, "barrier_wait_s": 0.0}

    def problem(line: dict[str, Any]) -> str | None:
        path = tmp_path / "r.jsonl"
        path.write_text(json.dumps(line) + "\n")
        skipped = read_record_file(path).skipped
        return skipped[0].reason.removeprefix("sample line: ") if skipped else None

    assert problem(row) is None
    assert problem({**row, "train_step_slowdown": -0.02, "train_lost_s": -0.1}) is None
    assert problem({**row, "rank": True}) == "rank is not an integer"
    assert problem({**row, "requests": []}) == "requests is not an object"
    assert problem({k: v for k, v in row.items() if k != "host"}) == "no host"
    assert problem({**row, "requests": {"by_type": {"GET": {"count": -1}}}}) == (
        "requests.by_type.GET.count is negative")


@pytest.mark.parametrize("change, reason", [
    ({"world_size": "2"}, "world_size is not an integer"),
    ({"config": {"storage": "s3"}}, "config.storage is not an object"),
    ({"model": {"preset": ["tiny"]}}, "model.preset is not text"),
    ({"init": [{"rank": -1}]}, "init[0].rank is negative"),
])
def test_a_run_line_with_a_field_of_the_wrong_type_skips_its_file(tmp_path, capsys, change,
                                                                  reason):
    write_record(tmp_path / "bad.jsonl", lambda rows: rows[0].update(change), run_id="bad")
    write_record(tmp_path / "good.jsonl", run_id="good")
    result, notes = read(tmp_path)
    assert list(result["runs"]["run_id"]) == ["good"]
    assert notes == [f"1 file(s) skipped, run line: {reason}: {tmp_path / 'bad.jsonl'}"]


def _append(path: Path, text: str) -> Path:
    with open(path, "a") as out:
        out.write(text)
    return path


def test_a_stray_line_after_a_whole_record_is_skipped_and_the_run_reported(tmp_path, capsys):
    """Trial case 93: `this is not json {` after a whole record: the run line's count shows
    every sample there, so the run reports, with a note naming the line."""
    whole, _ = read(write_record(tmp_path / "whole" / "r.jsonl"))
    path = _append(write_record(tmp_path / "stray" / "r.jsonl"), "this is not json {\n")
    result, notes = read(path)
    assert result["not_ok"].empty and aggregate_mib_s(result) == aggregate_mib_s(whole)
    (note,) = notes
    assert note.startswith("1 line(s) skipped, not JSON (damaged or not a record line)")
    assert f"{path}:{len(lines(ONE_ITERATION)) + 1}" in note
    code, out, err = run_report(capsys, str(path))
    assert code == 0 and "Throughput" in out and "incomplete" not in out + err
    _, notes = read(path, tmp_path / "whole")  # of two copies, the one without it is kept
    assert any(note.startswith("1 duplicate record(s) skipped") and f"{path} (kept:" in note
               for note in notes), notes


@pytest.mark.parametrize("damage", ["drop_rank", "cut_sample", "no_count"])
def test_a_non_json_line_is_a_lost_sample_where_that_is_known(tmp_path, damage):
    """A stray line beside a sample really missing (the count says so), a sample line cut
    part way (its start says so), or a record with no sample count to check: left out."""
    def change(rows):
        if damage == "drop_rank":
            rows.pop()
        elif damage == "no_count":
            rows[0]["schema_version"] = 1

    path = write_record(tmp_path / "r.jsonl", change)
    if damage == "cut_sample":
        cut_last_line(path, keep_fraction=0.1)  # `{"record": "sa`: a sample line's start
    else:
        _append(path, "this is not json {\n")
    reason = read(path)[0]["not_ok"].set_index("status").loc["incomplete", "error"]
    expected = {"drop_rank": "no sample of rank(s) 1",
                "cut_sample": "1 unreadable line(s) in its record file: cut off or damaged, "
                              "a rank's sample is lost",
                "no_count": "no sample count to show whether a rank's sample is lost"}[damage]
    assert expected in reason


# -- issue 31: hostile record files (WRONG 4) and control characters in fields (WRONG 5) ----

@pytest.mark.parametrize("depth", [100_000, 950])
def test_a_deeply_nested_line_is_skipped_and_the_run_reported(tmp_path, capsys, depth):
    """One line of nested brackets beside a whole record: deeper than the parser goes
    (RecursionError), or just under it (asdict and pandas recurse per level): skipped with
    its reason, the run still reports."""
    path = _append(write_record(tmp_path / "r.jsonl"), "[" * depth + "]" * depth + "\n")
    code, out, err = run_report(capsys, str(path))
    assert code == 0 and "Traceback" not in err, err
    assert "Throughput" in out and "incomplete" not in out + err
    flat = " ".join((out + err).split())  # the note wraps at the terminal's width
    assert "1 line(s) skipped, nested too deeply (damaged or not a record line)" in flat


def test_a_deeply_nested_value_in_a_sample_line_skips_that_line(tmp_path, capsys):
    deep: list = [[]]
    for _ in range(900):
        deep = [deep]
    path = write_record(tmp_path / "r.jsonl", lambda rows: rows[1].update(requests=deep))
    code, out, err = run_report(capsys, str(path))
    assert code == 0 and "Traceback" not in err, err
    assert "nested too deeply (a sample line cut off or damaged)" in " ".join(out.split())


def test_a_401_digit_byte_count_skips_its_line(tmp_path, capsys):
    write_record(tmp_path / "big.jsonl", lambda rows: rows[1].update(bytes=int("9" * 401)),
                 run_id="big")
    write_record(tmp_path / "good.jsonl", run_id="good")
    result, notes = read(tmp_path)
    assert set(result["operations"]["run_id"]) == {"good"}
    assert notes == ["1 line(s) skipped, sample line: bytes is out of range (2**63 or more): "
                     f"{tmp_path / 'big.jsonl'}:2"]
    code, out, err = run_report(capsys, str(tmp_path))
    assert code == 0 and "Traceback" not in err


def test_control_characters_of_a_record_never_reach_the_terminal(tmp_path, capsys):
    """A record's `error` and `model` (anyone's who can write the results directory) with
    ESC[2J and a newline: `report` prints them escaped, each row whole."""
    hostile = "\x1b[2J\x1b]0;owned\x07line\nbreak"

    def change(rows):
        rows[0].update(status="failed", error=f"rank 0: {hostile}")
        rows[0]["model"]["preset"] = f"tiny{hostile}"

    write_record(tmp_path / "hostile.jsonl", change, run_id="hostile")
    write_record(tmp_path / "good.jsonl", lambda rows: rows[0]["model"].update(
        preset=f"tiny{hostile}"), run_id="good")
    for args in ([], ["--format", "md"]):
        code, out, err = run_report(capsys, str(tmp_path), *args)
        assert code == 0, err
        shown = out + err
        assert not any(ch in shown for ch in "\x1b\x07\r"), repr(shown)
        escaped = r"\x1b[2J\x1b]0;owned\x07line\nbreak"
        assert f"rank 0: {escaped}" in shown and f"tiny{escaped}" in shown, shown
        assert not any(line.startswith("break") for line in shown.splitlines()), shown
