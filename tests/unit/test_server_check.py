"""storage.metrics_url (launch/server_check.py): the record's request counts against a
server's Prometheus counters, served here by a small HTTP endpoint whose counters the test
sets (the real SeaweedFS: tests/integration/test_request_counts.py)."""

from __future__ import annotations

import collections
import http.server
import json
import threading

import pytest

from dcp_fsdp.launch.server_check import ServerCheck
from dcp_fsdp.telemetry import server_counters


class Counters(http.server.BaseHTTPRequestHandler):
    text = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = type(self).text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def metrics(put: int, head_404: int) -> str:
    return "\n".join([
        'SeaweedFS_s3_request_total{bucket="",code="200",type="LIST"} 7',  # its own start-up
        f'SeaweedFS_s3_request_total{{bucket="b",code="200",type="PUT"}} {put}',
        f'SeaweedFS_s3_request_total{{bucket="b",code="404",type="GET"}} {head_404}',
        'SeaweedFS_s3_request_total{bucket="other",code="200",type="PUT"} 99'])


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.setattr(server_counters, "SETTLE_POLL_S", 0.01)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counters)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def record(path, put: int) -> None:
    sample = {"record": "sample", "op": "save", "rank": 0, "requests": {
        "by_type": {"UploadPart": {"status": {"200": put}},
                    "HeadObject": {"status": {"404": 1}}}, "unparsed": 0}}
    path.write_text(json.dumps({"record": "run", "untimed_requests": {"by_type": {}}}) + "\n"
                    + json.dumps(sample) + "\n")


@pytest.mark.parametrize("put_sent, put_recorded", [(3, 3), (3, 2)])
def test_the_run_line_says_whether_the_record_matches_the_server(endpoint, tmp_path, capsys,
                                                                 put_sent, put_recorded):
    Counters.text = metrics(put=10, head_404=4)
    check = ServerCheck(endpoint, "b")
    check.begin()
    Counters.text = metrics(put=10 + put_sent, head_404=5)
    path = tmp_path / "run.jsonl"
    record(path, put_recorded)
    check.end(path)
    run = json.loads(path.read_text().splitlines()[0])
    result = run["server_requests"]
    assert result["server"] == {"GET 404": 1, "PUT 200": put_sent}
    assert result["record"] == {"GET 404": 1, "PUT 200": put_recorded}
    said = capsys.readouterr()
    err = said.out + said.err
    if put_sent == put_recorded:
        assert result["match"] and result["differences"] == {}
        assert "the record's 4 match the server's own counters" in err
    else:
        assert not result["match"] and result["differences"] == {"PUT 200": -1}
        assert "differ from the server's own counters (record - server: PUT 200 -1" in err
    assert len(path.read_text().splitlines()) == 2  # the samples kept as they were


def test_an_unreadable_metrics_url_is_one_warning_and_no_check(tmp_path, capsys):
    check = ServerCheck("http://127.0.0.1:9/metrics", "b")
    check.begin()
    path = tmp_path / "run.jsonl"
    record(path, 1)
    check.end(path)
    assert "server_requests" not in json.loads(path.read_text().splitlines()[0])
    assert "could not be read" in capsys.readouterr().err


def test_report_notes_runs_whose_counts_the_server_contradicts(tmp_path, capsys):
    from dcp_fsdp.analysis import report
    from tests.unit.analysis_kit import ONE_ITERATION, variant

    agree = {"source": "http://h:1/metrics", "match": True, "record": {"PUT 200": 3},
             "server": {"PUT 200": 3}, "differences": {}, "incomplete": []}
    variant(tmp_path, "agrees", ONE_ITERATION, run={"server_requests": agree})
    assert report.main([str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # notes are wrapped to the terminal
    assert ("request counts of 1 run(s) checked against their S3 server's own counters "
            "(storage.metrics_url): all match") in out
    differ = {**agree, "match": False, "server": {"PUT 200": 4}, "differences": {"PUT 200": -1}}
    variant(tmp_path, "differs", ONE_ITERATION, run={"server_requests": differ})
    assert report.main([str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("run differs: its request counts differ from the S3 server's own counters "
            "(record - server: PUT 200 -1)") in out and "all match" not in out
    variant(tmp_path, "differs", ONE_ITERATION,
            run={"server_requests": {**differ, "cause": "server_restarted"}})
    assert report.main([str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(record - server: PUT 200 -1): the server restarted during the run" in out


def test_a_server_restart_and_unanswered_requests_are_named_not_another_client(
        endpoint, tmp_path, capsys):
    """Issue 31: a mismatch blamed "another client" where the server restarted (its
    counters start at zero) or requests got no answer that a stalled server counts later."""
    Counters.text = metrics(put=10, head_404=4)
    check = ServerCheck(endpoint, "b")
    check.begin()
    Counters.text = metrics(put=2, head_404=0)  # restarted: counting again from zero
    path = tmp_path / "run.jsonl"
    record(path, 3)
    check.end(path)
    result = json.loads(path.read_text().splitlines()[0])["server_requests"]
    assert not result["match"] and result["cause"] == "server_restarted"
    err = capsys.readouterr().err
    assert "the server's counters went back during the run: it restarted" in err
    assert "another client" not in err

    check = ServerCheck(endpoint, "b")
    check.begin()
    Counters.text = metrics(put=4, head_404=1)  # 2 PUTs counted; the third not yet answered
    record(path, 3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["requests"]["status"] = {"200": 2, "404": 1, "none": 1}
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    check.end(path)
    result = json.loads(path.read_text().splitlines()[0])["server_requests"]
    assert result["cause"] == "unanswered_requests" and result["unanswered"] == 1
    err = capsys.readouterr().err
    assert "1 request(s) got no answer before the client gave up" in err
    assert "another client" not in err


@pytest.mark.parametrize("record_counts, server_counts, cause", [
    # the server answered 2 UploadParts whose answers the client never saw (retried: 2 more)
    ({("PUT", "200"): 10, ("PUT", "none"): 2}, {("PUT", "200"): 12}, "unanswered_requests"),
    # one unanswered, answered later or never: the server has fewer
    ({("PUT", "200"): 10, ("PUT", "none"): 1}, {("PUT", "200"): 10}, "unanswered_requests"),
    # more surplus than unanswered requests: another client
    ({("PUT", "200"): 10, ("PUT", "none"): 1}, {("PUT", "200"): 12}, None),
    # the surplus is of another type than the unanswered requests
    ({("PUT", "200"): 10, ("PUT", "none"): 2}, {("PUT", "200"): 10, ("GET", "200"): 2}, None),
    # a status the client saw that the server lacks, beside a surplus
    ({("PUT", "200"): 10, ("PUT", "none"): 2, ("GET", "404"): 1}, {("PUT", "200"): 12}, None),
])
def test_answers_the_client_never_saw_are_named_not_another_client(record_counts, server_counts,
                                                                    cause):
    """A 2-core VM's L7b save to the embedded server: `PUT 200 -42, PUT none +42` was blamed
    on another client; the server had answered 42 UploadParts the client gave up on."""
    unanswered = sum(n for (_, code), n in record_counts.items() if code == "none")
    result = server_counters.compare(collections.Counter(record_counts), collections.Counter(server_counts), [],
                     "metrics", unanswered=unanswered)
    assert not result["match"] and result["cause"] == cause


@pytest.mark.parametrize(("record_counts", "server_counts", "cause"), [
    # a cut UploadPart sent again below botocore: one more on the server's side
    ({("PUT", "200"): 10, ("POST", "200"): 2}, {("PUT", "200"): 11, ("POST", "200"): 2},
     "resent_below_client"),
    # a surplus of a request type the run never made: not its client's re-send
    ({("PUT", "200"): 10}, {("PUT", "200"): 10, ("DELETE", "204"): 1}, None),
    # the server short of something the record holds: not a re-send
    ({("PUT", "200"): 10, ("GET", "200"): 3}, {("PUT", "200"): 12, ("GET", "200"): 2}, None),
])
def test_a_client_that_resends_below_the_count_is_named_for_its_surplus(record_counts,
                                                                         server_counts, cause):
    """s3fs re-sent a cut upload below the layer the tool counts (record `failed 0`): the
    warning blamed another client of the bucket."""
    result = server_counters.compare(collections.Counter(record_counts),
                                     collections.Counter(server_counts), [], "metrics",
                                     resends_unseen=True)
    assert not result["match"] and result["cause"] == cause
    unflagged = server_counters.compare(collections.Counter(record_counts),
                                        collections.Counter(server_counts), [], "metrics")
    assert unflagged["cause"] is None
