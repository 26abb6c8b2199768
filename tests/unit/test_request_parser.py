"""The connector-log parser's guards (telemetry/connector_log.py): tied to the connector
releases it was checked on, strict about the fields it reads, its format recorded; and
requests counted by the operation their meta request began in, however late their line
reaches the file (telemetry/request_log.py)."""

from __future__ import annotations

import threading
import time
from importlib import metadata

import pytest

from dcp_fsdp.telemetry import connector_log, request_log
from dcp_fsdp.telemetry.connector_log import PARSER_FORMAT, Request, Unparsed
from dcp_fsdp.telemetry.request_log import RequestLog
from dcp_fsdp.telemetry.summaries import merge_summaries, summarize
from tests.kit.request_lines import parse_all
from tests.unit.test_request_log import (CRT_404, REAL_SAVE_LOAD, SPAN_GET, line, new_request,
                                         request)

HEAD = 'head_object{id=0 bucket="b" key="p/s/.metadata"}'
PUT = 'put_object{id=1 bucket="b" key="p/s/__0_0.distcp"}'
LOG_NAME = "s3torchconnectorclient.log.2026-11-22-23"


def epoch(stamp: str) -> float:
    return connector_log._epoch(f"2026-11-22T23:14:{stamp}Z")  # noqa: SLF001


# -- (c) strict: a reworded field is unparsed, never a failure, a blank or 0 bytes ----------

REWORDED = [
    # http_status= renamed: a HEAD 404 that would read as a failed, retried request
    request("27.127", HEAD, "failed", "HeadObject", 404, crt=CRT_404).replace(
        "http_status=", "status_code="),
    # ... and a finished request without a status
    request("27.131", PUT, "finished", "CreateMultipartUpload", 200).replace(
        "http_status=", "status="),
    # Rust's Duration debug format changed: a latency that would go blank
    request("27.279", PUT, "finished", "UploadPart", 200, duration="Duration(0.12)"),
    # range= changed: a GET whose bytes would be 0
    request("27.424", SPAN_GET, "finished", "GetObject", 206, rng="Some(0..8388608)").replace(
        "range=", "byte_range="),
    request("27.425", SPAN_GET, "finished", "GetObject", 206, rng="Some(bytes=0-8388607)"),
    # ttfb in an unknown shape, and a line without its request_type
    request("27.426", SPAN_GET, "finished", "GetObject", 206, rng="Some(0..1)", ttfb="1ms"),
    line("27.427", PUT, "S3 request finished crt_error=None http_status=200 range=None "
         "duration=1ms ttfb=None"),
]


def test_reworded_request_lines_are_unparsed_not_failures_blanks_or_zero_bytes():
    items = parse_all(REWORDED)
    assert all(isinstance(item, Unparsed) for item in items), items
    reasons = [item.reason for item in items if isinstance(item, Unparsed)]
    assert reasons == ["http_status", "http_status", "duration", "range", "range", "ttfb",
                       "request_type"]
    # the lines that still read as they should parse as before
    assert [type(item).__name__ for item in parse_all(REAL_SAVE_LOAD)].count("Request") == 10


def test_a_failure_without_any_response_needs_no_status():
    refused = request("32.0", HEAD, "failed", "HeadObject", ttfb="None",
                      crt='Some(Error(1047, "aws-c-io: AWS_IO_SOCKET_CONNECTION_REFUSED"))')
    item, = parse_all([refused])
    assert isinstance(item, Request)
    assert item.outcome == "failed" and item.status is None and item.retried
    canceled, = parse_all([request("32.2", SPAN_GET, "canceled", "GetObject",
                                   rng="Some(0..5)")])
    assert isinstance(canceled, Request) and canceled.outcome == "canceled"


# A ranged GET cut by tests/kit/fault_proxy.py after 3 MiB of its 8 MiB body, then re-sent
# (shapes copied from a real s3torchconnector 1.5.0 log; issue 31 item 2): the connector
# says "finished", with the 206 and the broken socket's crt_error.
SOCKET_CLOSED = 'Some(Error(1051, "aws-c-io: AWS_IO_SOCKET_CLOSED, socket is closed."))'
CUT_GET = [
    new_request("34.921113", SPAN_GET),
    request("35.223832", SPAN_GET, "finished", "GetObject", 206, rng="Some(0..8388608)",
            duration="292.554888ms", ttfb="Some(8.523585ms)", crt=SOCKET_CLOSED),
    request("35.292703", SPAN_GET, "finished", "GetObject", 206, rng="Some(0..8388608)",
            duration="68.976857ms", ttfb="Some(25.119308ms)"),
    request("35.460328", SPAN_GET, "finished", "GetObject", 206,
            rng="Some(8388608..12003154)", duration="156.457314ms", ttfb="Some(58.8ms)"),
    line("35.495096", SPAN_GET, "meta request finished duration=573.84186ms"),
]


def test_a_get_whose_body_broke_is_a_failed_retried_attempt_not_bytes_down():
    """Without the crt_error reading, the cut GET is a success: retries 0, failed 0, and
    its whole 8 MiB range in bytes_down although 3 MiB of it came down."""
    cut, again, rest = parse_all(CUT_GET)
    assert isinstance(cut, Request) and isinstance(again, Request)
    assert (cut.outcome, cut.retryable, cut.retried) == ("failed", True, True)  # before: ok
    assert cut.broken
    assert again.outcome == "ok" and not again.broken
    summary = summarize([r for r in (cut, again, rest) if isinstance(r, Request)])
    assert (summary["count"], summary["failed"], summary["retries"]) == (3, 1, 1)
    assert summary["broken"] == 1
    # the whole bodies: the re-sent part and the rest of the object, each once
    assert summary["bytes_down"] == summary["by_type"]["GetObject"]["bytes"] == 12003154
    assert summary["bytes_down_broken_max"] == 8388608  # some of it came, at most all
    merged = merge_summaries([summary, summary])
    assert merged is not None and merged["broken"] == 2
    assert merged["bytes_down_broken_max"] == 2 * 8388608


def test_a_get_that_broke_on_its_last_attempt_was_not_retried():
    given_up = CUT_GET[:2] + [line("35.3", SPAN_GET, "meta request failed duration=300ms")]
    cut, = parse_all(given_up)
    assert isinstance(cut, Request) and cut.outcome == "failed" and not cut.retried


def test_a_window_counts_unparsed_lines_apart_and_records_the_parser(tmp_path, capsys):
    directory = tmp_path / "rank0"
    directory.mkdir()
    (directory / LOG_NAME).write_text("\n".join(REAL_SAVE_LOAD[:10] + REWORDED[:3]) + "\n")
    log = RequestLog(directory)
    save = log.window(epoch("27.12"), epoch("27.31"), bytes_up=1000, moved_bytes=1000)
    assert save is not None
    assert save["count"] == 5 and save["unparsed"] == 3
    assert save["failed"] == 0 and save["retries"] == 0  # the renamed 404 is no failure
    assert save["parser"] == PARSER_FORMAT
    untimed = log.finish()
    assert untimed["unparsed"] == 0 and untimed["parser"] == PARSER_FORMAT
    merged = merge_summaries([save, save])
    assert merged is not None
    assert merged["unparsed"] == 6 and merged["parser"] == PARSER_FORMAT
    assert sum("could not be parsed" in text for text in capsys.readouterr().err.splitlines()) == 1


# -- (a) the connector releases it was checked on ---------------------------------------

def test_the_installed_connector_is_a_checked_release():
    assert connector_log.version_problem() is None
    for package, checked in connector_log.CHECKED_RELEASES.items():
        assert metadata.version(package) in checked


def test_an_unchecked_release_blanks_the_rank_request_log(monkeypatch, capsys):
    monkeypatch.setitem(connector_log.CHECKED_RELEASES, "s3torchconnectorclient", ("1.4.0",))
    problem = connector_log.version_problem()
    assert problem is not None
    assert problem.startswith(f"s3torchconnectorclient {metadata.version('s3torchconnectorclient')}"
                              " is not a release the request-log parser was checked against")
    assert "request_stats=false" in problem
    assert request_log.open_for_rank(0) is None  # no log: requests unknown, never guessed
    assert "S3 request statistics are not recorded" in capsys.readouterr().err


def test_the_run_record_names_the_parser_or_null_when_it_was_refused(monkeypatch):
    from dcp_fsdp.telemetry.records import versions

    assert versions()["request_parser"] == PARSER_FORMAT
    assert versions()["s3torchconnectorclient"] == metadata.version("s3torchconnectorclient")
    monkeypatch.setitem(connector_log.CHECKED_RELEASES, "s3torchconnector", ("9.9.9",))
    assert versions()["request_parser"] is None


# -- item 7: a request counts in the operation its meta request began in --------------------

def _late_lines(complete_at: str) -> list[str]:
    return [request(complete_at, PUT, "finished", "CompleteMultipartUpload", 200),
            line(complete_at, PUT, "meta request finished duration=20ms")]


def test_a_complete_that_reaches_the_file_after_the_operation_counts_in_it(tmp_path):
    """The data file's Complete (and its meta request's end) reach the file 0.3 s after the
    window is asked for, one of them stamped after the operation's end: the window waits for
    the meta request it saw begin, and counts them in its operation."""
    directory = tmp_path / "rank0"
    directory.mkdir()
    path = directory / LOG_NAME
    path.write_text("\n".join([
        new_request("27.130", PUT),
        request("27.131", PUT, "finished", "CreateMultipartUpload", 200),
        request("27.279", PUT, "finished", "UploadPart", 200),
    ]) + "\n")
    begin, end = epoch("27.10"), epoch("27.30")

    def write_late() -> None:
        time.sleep(0.3)
        with open(path, "a") as out:  # the Complete after `end`: a CRT thread ran late
            out.write("\n".join(_late_lines("27.302")) + "\n")
            out.write(new_request("27.50", 'put_object{id=9 bucket="b" key="p/t/x"}') + "\n")
    writer = threading.Thread(target=write_late)
    writer.start()
    try:
        save = RequestLog(directory).window(begin, end, bytes_up=10, moved_bytes=10)
        assert save is not None
    finally:
        writer.join()
    assert save["by_type"]["CompleteMultipartUpload"]["count"] == 1
    assert save["count"] == 3 and save["unparsed"] == 0


def test_a_request_line_later_than_the_wait_is_reported_late_not_in_the_next_operation(
        tmp_path):
    directory = tmp_path / "rank0"
    directory.mkdir()
    path = directory / LOG_NAME
    path.write_text("\n".join([new_request("27.130", PUT),
                               request("27.131", PUT, "finished", "CreateMultipartUpload",
                                       200)]) + "\n")
    log = RequestLog(directory, settle_s=0.05)
    save = log.window(epoch("27.10"), epoch("27.30"), bytes_up=10, moved_bytes=10)
    assert save is not None
    assert save["count"] == 1  # the wait ended with the meta request still open
    with open(path, "a") as out:
        out.write("\n".join(_late_lines("27.200")) + "\n")
    following = log.window(epoch("28.0"), epoch("29.0"))
    assert following is not None
    assert following["count"] == 0  # not the next operation's
    untimed = log.finish()
    assert untimed["count"] == 1 and untimed["late"] == 1
    assert untimed["by_type"]["CompleteMultipartUpload"]["count"] == 1


@pytest.mark.parametrize("begun, ended", [("27.05", "27.20"), ("27.35", "27.36")])
def test_a_meta_request_begun_outside_the_operation_is_not_its(tmp_path, begun, ended):
    """A load's rank 0 reads .metadata before the timer: its GET, ending inside the window,
    stays untimed; one begun after the window stays for the next."""
    directory = tmp_path / "rank0"
    directory.mkdir()
    (directory / LOG_NAME).write_text("\n".join([
        new_request(begun, SPAN_GET),
        request(ended, SPAN_GET, "finished", "GetObject", 206, rng="Some(0..10)"),
        line(ended, SPAN_GET, "meta request finished duration=1ms")]) + "\n")
    log = RequestLog(directory)
    window = log.window(epoch("27.10"), epoch("27.30"))
    assert window is not None and window["count"] == 0
    assert log.finish()["count"] == 1


def test_the_report_takes_counts_with_unparsed_lines_as_unknown():
    import math

    from dcp_fsdp.analysis.metrics import samples_frame

    base = {"op": "save", "bytes": 10, "duration_s": 1.0}
    frame = samples_frame([{**base, "requests": {"count": 5, "unparsed": 0}},
                           {**base, "requests": {"count": 4, "unparsed": 1}}])
    assert frame["req_count"][0] == 5 and math.isnan(frame["req_count"][1])
