"""S3 request statistics: the connector log parser on recorded real line shapes,
histograms, timed windows, and the SeaweedFS counter mapping (no server)."""

from __future__ import annotations

import json

import pytest

from dcp_fsdp import compat
from dcp_fsdp.process.failures import ErrorAnswers
from dcp_fsdp.telemetry import request_log
from dcp_fsdp.telemetry.histograms import hist_merge, hist_quantile, histogram
from dcp_fsdp.telemetry.request_log import RequestLog
from dcp_fsdp.telemetry.summaries import merge_summaries, summarize
from tests.kit.request_lines import parse_lines
from tests.kit.seaweed_counters import parse_server_metrics, server_view

SPAN_PUT = 'put_object{id=1 bucket="b" key="p/s/__0_0.distcp"}'
SPAN_GET = 'get_object{id=1 bucket="b" key="p/s/__0_0.distcp" range=Some(0..12003154) if_match=None}'
TARGET = "mountpoint_s3_client::s3_crt_client"
CRT_404 = ('Some(Error(14343, "aws-c-s3: AWS_ERROR_S3_INVALID_RESPONSE_STATUS, Invalid response '
           'status from request"))')


def line(stamp: str, span: str, text: str, level: str = "DEBUG") -> str:
    return f"2026-11-22T23:14:{stamp}Z {level} {span}: {TARGET}: {text}"


def new_request(stamp: str, span: str) -> str:
    name = span.split("{", 1)[0]
    return f"2026-11-22T23:14:{stamp}Z DEBUG {span}: {TARGET}::{name}: new request"


def request(stamp, span, outcome, rtype, status=None, rng="None", duration="1.5ms",
            ttfb="Some(1.2ms)", crt="None"):
    status_part = f" http_status={status}" if status is not None else ""
    return line(stamp, span, f"S3 request {outcome} request_type={rtype} crt_error={crt}"
                f"{status_part} range={rng} duration={duration} ttfb={ttfb} "
                "request_id=<unknown>")


# Shapes copied from a real s3torchconnector 1.5.0 log (save, then load).
REAL_SAVE_LOAD = [
    "2026-11-22T23:14:27.106623Z DEBUG mountpoint_s3_client::s3_crt_client: using AWS_ENDPOINT_URL "
    "http://127.0.0.1:49431",
    new_request("27.124722", 'head_object{id=0 bucket="b" key="p/s/.metadata"}'),
    request("27.127038", 'head_object{id=0 bucket="b" key="p/s/.metadata"}', "failed",
            "HeadObject", 404, crt=CRT_404, duration="1.854149ms", ttfb="Some(1.420417ms)"),
    line("27.127273", 'head_object{id=0 bucket="b" key="p/s/.metadata"}',
         "duration=2.520859ms request_id=18EA error=ServiceError(NotFound) meta request failed"),
    "2026-11-22T23:14:27.127337Z ERROR _mountpoint_s3_client::exception: ERROR: S3Exception: "
    "Service error: The object was not found",
    request("27.131010", SPAN_PUT, "finished", "CreateMultipartUpload", 200),
    request("27.279627", SPAN_PUT, "finished", "UploadPart", 200, duration="120.882396ms"),
    request("27.300016", SPAN_PUT, "finished", "UploadPart", 200, duration="146.98982ms"),
    request("27.302325", SPAN_PUT, "finished", "CompleteMultipartUpload", 200),
    line("27.302373", SPAN_PUT, "meta request finished duration=173.676399ms"),
    request("27.312186", 'copy_object{id=4 source_bucket="b" source_key="p/s/.metadata.tmp" '
            'destination_bucket="b" destination_key="p/s/.metadata"}', "finished", "HeadObject",
            200, ttfb="Some(0ns)", duration="665.32µs"),
    request("27.315278", 'copy_object{id=4 source_bucket="b" source_key="p/s/.metadata.tmp" '
            'destination_bucket="b" destination_key="p/s/.metadata"}', "finished", "CopyObject",
            200),
    request("27.317622", 'delete_object{id=5 bucket="b" key="p/s/.metadata.tmp"}', "finished",
            "Default", 204),
    request("27.424531", SPAN_GET, "finished", "GetObject", 206, rng="Some(0..8388608)",
            duration="43.984296ms"),
    request("27.436800", SPAN_GET, "finished", "GetObject", 206,
            rng="Some(8388608..12003154)", duration="1.2s"),
]


def test_parses_real_line_shapes_into_kinds_outcomes_and_bytes():
    requests = parse_lines(REAL_SAVE_LOAD)
    kinds = [r.kind for r in requests]
    assert kinds == ["HeadObject", "CreateMultipartUpload", "UploadPart", "UploadPart",
                     "CompleteMultipartUpload", "HeadObject", "CopyObject", "DeleteObject",
                     "GetObject", "GetObject"]
    head_404 = requests[0]
    assert head_404.outcome == "miss" and head_404.status == 404
    assert head_404.duration_s == pytest.approx(1.854149e-3)
    assert head_404.key == "p/s/.metadata"
    assert requests[5].ttfb_s == 0.0 and requests[5].duration_s == pytest.approx(665.32e-6)
    assert requests[7].status == 204  # request_type=Default in a delete_object span
    assert [r.nbytes for r in requests[8:]] == [8388608, 12003154 - 8388608]
    assert requests[9].duration_s == 1.2
    # Timestamps are UTC wall-clock seconds, comparable with time.time().
    assert requests[1].end_wall_s == pytest.approx(1795389267.131010, abs=1e-6)


def test_summary_counts_misses_apart_from_failures():
    summary = summarize(parse_lines(REAL_SAVE_LOAD), seconds=2.0, bytes_up=123)
    assert summary["count"] == 10 and summary["ok"] == 9 and summary["misses"] == 1
    assert summary["failed"] == 0 and summary["success_ratio"] == 1.0
    assert summary["req_per_s"] == 5.0 and summary["bytes_up"] == 123
    assert summary["bytes_down"] == 12003154
    assert summary["status"] == {"200": 6, "204": 1, "206": 2, "404": 1}
    assert summary["by_type"]["HeadObject"]["status"] == {"200": 1, "404": 1}
    assert summary["by_type"]["UploadPart"]["latency_ms"]["max"] == pytest.approx(146.98982)
    assert summary["by_type"]["GetObject"]["bytes"] == 12003154
    json.dumps(summary)  # it goes into the record as is


def test_throttles_retries_and_final_failures():
    span = 'put_object{id=7 bucket="b" key="k"}'
    other = 'put_object{id=8 bucket="b" key="k2"}'
    lines = [
        new_request("30.0", span),
        request("30.1", span, "failed", "UploadPart", 503, ttfb="None"),  # retried
        request("30.2", span, "finished", "UploadPart", 200),
        line("30.3", span, "meta request finished duration=3ms"),
        request("31.1", other, "failed", "UploadPart", 500),  # retried
        request("31.2", other, "failed", "UploadPart", 503),  # last attempt: given up
        line("31.3", other, "duration=3ms request_id=x error=ClientError(..) meta request failed",
             level="WARN"),
        request("32.0", 'head_object{id=9 bucket="b" key="k3"}', "failed", "HeadObject",
                crt='Some(Error(1047, "aws-c-io: AWS_IO_SOCKET_CONNECTION_REFUSED, socket '
                    'connection refused."))', ttfb="None"),  # no response at all
        request("32.1", 'get_object{id=3 bucket="b" key="k4" range=None if_match=None}',
                "failed", "GetObject", 403),  # not retryable
        request("32.2", 'get_object{id=4 bucket="b" key="k4" range=None if_match=None}',
                "canceled", "GetObject", None),
    ]
    requests = parse_lines(lines)
    assert [(r.outcome, r.status, r.retried) for r in requests] == [
        ("failed", 503, True), ("ok", 200, False), ("failed", 500, True),
        ("failed", 503, False), ("failed", None, True), ("failed", 403, False),
        ("canceled", None, False)]
    summary = summarize(requests, seconds=1.0)
    assert summary["failed"] == 5 and summary["throttled"] == 2 and summary["retries"] == 3
    assert summary["canceled"] == 1 and summary["ok"] == 1
    assert summary["success_ratio"] == pytest.approx(2 / 7)
    assert summary["status"]["none"] == 2


def test_histogram_quantiles_are_within_the_bucket_width():
    values = [1.0] * 40 + [10.0] * 59 + [1000.0]
    hist = histogram(values)
    assert hist_quantile(hist, 0.5) == pytest.approx(10.0, rel=0.07)
    assert hist_quantile(hist, 0.25) == pytest.approx(1.0, rel=0.07)
    assert hist_quantile(hist, 1.0) == pytest.approx(1000.0, rel=0.07)
    merged = hist_merge([hist, histogram([0.0, 0.0005])])  # below 1 µs: the lowest bucket
    assert sum(merged.values()) == 102 and hist_quantile({}, 0.5) is None


def test_request_log_splits_timed_windows_from_the_rest(tmp_path):
    directory = tmp_path / "rank0"
    directory.mkdir()
    first = directory / "s3torchconnectorclient.log.2026-11-22-23"
    first.write_text("\n".join(REAL_SAVE_LOAD[:10]) + "\n")
    log = RequestLog(directory)
    begin, end = 1795389267.12, 1795389267.31  # holds the HEAD 404 .. the first data file
    save = log.window(begin, end, bytes_up=1000)
    assert save is not None
    assert save["count"] == 5 and save["misses"] == 1 and save["bytes_up"] == 1000
    assert save is not None
    assert save["seconds"] == pytest.approx(0.19)
    # the next hour's file, and a half-written last line that must wait for its newline
    second = directory / "s3torchconnectorclient.log.2026-11-23-00"
    second.write_text("\n".join(REAL_SAVE_LOAD[10:]) + "\n" + REAL_SAVE_LOAD[0][:30])
    load = log.window(1795389267.4, 1795389267.5)
    assert load is not None
    assert load["count"] == 2 and load["bytes_down"] == 12003154
    untimed = log.finish()  # copy, delete (before the load window) and nothing after
    assert untimed["count"] == 3
    assert set(untimed["by_type"]) == {"HeadObject", "CopyObject", "DeleteObject"}
    kept = log.copy_raw(tmp_path / "kept" / "rank-00000.log")
    assert kept is not None
    assert kept.read_text().count("S3 request") == len(REAL_SAVE_LOAD) - 5
    merged = merge_summaries([untimed, untimed, None])
    assert merged is not None
    assert merged["count"] == 6 and merged["by_type"]["CopyObject"]["count"] == 2


def test_server_metrics_parse_and_mapping():
    text = "\n".join([
        "# HELP SeaweedFS_s3_request_total Counter of s3 requests.",
        'SeaweedFS_s3_request_total{bucket="",code="403",type="LIST"} 1',
        'SeaweedFS_s3_request_total{bucket="bench",code="200",type="POST"} 4',
        'SeaweedFS_s3_request_total{bucket="bench",code="404",type="GET"} 3',
        'SeaweedFS_s3_request_total{bucket="other",code="200",type="PUT"} 9',
    ])
    assert parse_server_metrics(text, "bench") == {("POST", "200"): 4, ("GET", "404"): 3}
    summary = summarize(parse_lines(REAL_SAVE_LOAD))
    view = server_view(summary["by_type"], {"HeadBucket": {"200": 1}})
    assert view == {("GET", "404"): 1, ("POST", "200"): 2, ("PUT", "200"): 2,
                    ("GET", "200"): 2, ("COPY", "200"): 1, ("DELETE", "204"): 1,
                    ("GET", "206"): 2}


# -- against a real server ---------------------------------------------------------------

def test_enable_refuses_after_the_connector_was_imported(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, compat.CONNECTOR_NATIVE_MODULE, object())
    assert request_log.open_for_rank(3) is None
    assert "request statistics are not recorded" in capsys.readouterr().err




def test_a_window_that_moved_bytes_without_parsed_requests_is_unknown_not_zero(tmp_path,
                                                                                capsys):
    from importlib import metadata

    directory = tmp_path / "rank0"
    directory.mkdir()
    # a connector release that words its request lines differently: nothing parses
    (directory / "s3torchconnectorclient.log.2026-11-22-23").write_text(
        "\n".join(text.replace("S3 request", "S3 call") for text in REAL_SAVE_LOAD) + "\n")
    log = RequestLog(directory)
    assert log.window(1795389267.125, 1795389267.31, bytes_up=1000, moved_bytes=1000) is None
    assert log.window(1795389267.4, 1795389267.5, moved_bytes=5) is None
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1  # one warning per process, naming the connector's version
    assert f"s3torchconnector {metadata.version('s3torchconnector')}" in warnings[0]
    # nothing moved (an empty window): a summary of no requests is the truth
    empty = log.window(1795389268.0, 1795389268.1, moved_bytes=0)
    assert empty is not None and empty["count"] == 0


def test_a_window_summarised_late_leaves_later_requests_to_the_next(tmp_path):
    """An async save with steps between saves is summarised once its upload is done, after
    the next save's requests are in the log: those stay for the next save's window."""
    directory = tmp_path / "rank0"
    directory.mkdir()
    (directory / "s3torchconnectorclient.log.2026-11-22-23").write_text(
        "\n".join(REAL_SAVE_LOAD) + "\n")
    log = RequestLog(directory)
    save = log.window(1795389267.12, 1795389267.31, bytes_up=1000)  # all lines already read
    assert save is not None
    assert save["count"] == 5
    load = log.window(1795389267.4, 1795389267.5)
    assert load is not None
    assert load["count"] == 2 and load["bytes_down"] == 12003154
    assert log.finish()["count"] == 3


def test_the_first_error_answer_of_a_failed_operation_is_counted_by_its_kind(tmp_path):
    """What a failed save's rank saw (no window took it): its first error answer, with how
    many attempts of that kind got it; a HEAD's 404 (a miss) is not an error answer."""
    crt_500 = ('Some(Error(14341, "aws-c-s3: AWS_ERROR_S3_INTERNAL_ERROR, Response code indicates '
               'internal server error"))')
    directory = tmp_path / "rank2"
    directory.mkdir()
    lines = [*REAL_SAVE_LOAD[1:5], new_request("27.130000", SPAN_PUT),
             request("27.131010", SPAN_PUT, "finished", "CreateMultipartUpload", 200),
             request("27.140000", SPAN_PUT, "failed", "UploadPart", 500, crt=crt_500),
             request("27.150000", SPAN_PUT, "finished", "UploadPart", 200),
             request("27.160000", SPAN_PUT, "failed", "UploadPart", 500, crt=crt_500),
             line("27.170000", SPAN_PUT, "duration=40ms request_id=1 error=ClientError meta "
                  "request failed")]
    (directory / "s3torchconnectorclient.log.2026-11-22-23").write_text("\n".join(lines) + "\n")
    answers = RequestLog(directory).error_answers(rank=2)
    assert answers == ErrorAnswers(rank=2, kind="UploadPart", status=500, answered=2, attempts=3)
    (tmp_path / "fine").mkdir()
    (tmp_path / "fine" / "s3torchconnectorclient.log.2026-11-22-23").write_text(
        "\n".join(REAL_SAVE_LOAD) + "\n")
    assert RequestLog(tmp_path / "fine").error_answers(rank=0) is None
