"""`report` and the S3 client of each record (analysis/clients.py): a record without
storage.client, a client the reader does not know, and `x connector` from single iterations
are each said in one note (issue 49, unclear items)."""

from __future__ import annotations

import math

from dcp_fsdp.analysis import report
from tests.unit.analysis_kit import ONE_ITERATION, variant


def _build(directory):
    runs, samples, _ = report.read_records(report.record_files([str(directory)]))
    return report.build(runs, samples)


def _row(table, op, client):
    rows = table[(table["op"] == op) & (table["storage.client"] == client)]
    assert len(rows) == 1, table[["op", "storage.client"]]
    return rows.iloc[0]


def test_a_record_without_the_client_is_counted_as_the_connectors_and_named(tmp_path):
    """The kit's records predate storage.client: beside a connector's record they were pooled
    with it without a word (and beside another client's they made a row with a blank client)."""
    old = variant(tmp_path, "old")  # no storage.client: written when the connector was the only one
    variant(tmp_path, "conn", settings={"storage.client": "s3torchconnector"})
    result = _build(tmp_path)
    assert result["throughput"]["runs"].tolist() == [2, 2]  # pooled, as before ...
    (note,) = [n for n in result["notes"] if "storage.client" in n]  # ... but said
    assert note.startswith("1 S3 record(s) have no storage.client") and str(old) in note, note
    assert "counted as storage.client=s3torchconnector" in note

    variant(tmp_path, "msc", settings={"storage.client": "msc"})
    table = _build(tmp_path)["throughput"]
    assert set(table["storage.client"]) == {"s3torchconnector", "msc"}  # no blank client row
    assert _row(table, "save", "s3torchconnector")["runs"] == 2


def test_an_unknown_client_gets_no_ratio_and_a_note(tmp_path):
    variant(tmp_path, "conn", settings={"storage.client": "s3torchconnector"})
    bogus = variant(tmp_path, "bogus", settings={"storage.client": "bogus"})
    variant(tmp_path, "msc", settings={"storage.client": "msc"})
    result = _build(tmp_path)
    table = result["throughput"]
    assert math.isnan(_row(table, "save", "bogus")["vs_connector"])
    assert _row(table, "save", "msc")["vs_connector"] == 1.0  # the kit's copies: the same figure
    (note,) = [n for n in result["notes"] if "does not know" in n]
    assert "storage.client this reader does not know (bogus;" in note and str(bogus) in note, note


def test_a_ratio_from_single_iterations_carries_a_caution(tmp_path):
    variant(tmp_path, "conn", settings={"storage.client": "s3torchconnector"})
    variant(tmp_path, "fsspec", ONE_ITERATION, settings={"storage.client": "fsspec"})
    result = _build(tmp_path)
    assert not math.isnan(_row(result["throughput"], "save", "fsspec")["vs_connector"])
    (note,) = [n for n in result["notes"] if n.startswith("x connector")]
    assert "2 row(s) rests on a single iteration" in note and "(save fsspec, load fsspec)" in note
    assert "iterations=3" in note
    # two iterations of each client: no caution
    variant(tmp_path, "fsspec", settings={"storage.client": "fsspec"})
    assert not [n for n in _build(tmp_path)["notes"] if n.startswith("x connector")]
