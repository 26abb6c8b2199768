"""torch 2.11 renews its async stager after each save: the end-of-run lines and the report
say so when a record's saves carry `stager_renewed` (records copied from real ones)."""

from __future__ import annotations

import pytest

from dcp_fsdp.analysis import report
from dcp_fsdp.analysis.run_summary import STAGER_RENEWED, async_lines
from dcp_fsdp.telemetry.records import read_record_file
from tests.unit.analysis_kit import variant


def as_async_save(renewed):
    def change(row):
        if row["op"] == "save":
            row.update(save_mode="async", stall_s=row["duration_s"] / 2,
                       persisted_s=row["duration_s"], blocked_s=row["duration_s"] / 4,
                       stager_renewed=renewed)
        return row
    return change


@pytest.mark.parametrize("renewed", [True, False, None])
def test_the_end_of_run_lines_and_the_report_say_when_the_stager_was_renewed(tmp_path,
                                                                             renewed):
    path = variant(tmp_path, "async-run", settings={"save_mode": "async"},
                   sample=as_async_save(renewed))
    samples = read_record_file(path).samples
    assert {s.stager_renewed for s in samples if s.op == "save"} == {renewed}
    lines = async_lines(samples)
    assert lines and lines[0].startswith("async save 1:")
    assert (STAGER_RENEWED in lines) is (renewed is True)
    runs, rows, warnings = report.read_records(report.record_files([str(tmp_path)]))
    result = report.build(runs, rows)
    assert (STAGER_RENEWED in result["notes"]) is (renewed is True)
    text = report.render(result, "table", [*warnings, *result["notes"]])
    assert ("stager_renewed" in text) is (renewed is True)
