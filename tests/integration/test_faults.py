"""Fault injection on loopback: our FaultProxy (tests/kit/fault_proxy.py) between the
client and SeaweedFS answers 503 SlowDown, resets connections mid-body, stalls, or
redirects to another region.

* The proxy itself (boto3 through it): signed requests pass byte for byte, each fault
  reaches the client as S3 would send it, decisions are reproducible per seed.
* The tool through it: with 10 % 503s and occasional resets on the data plane, 2-rank
  save-and-load completes bit-exactly (it verifies itself) and the records count the
  throttles and retries; with retries exhausted it fails in bounded time with one
  clear line and a failed record; a stalled response ends at op_timeout_s.

Faults target the data plane only (UploadPart, ranged GET: the CRT client's requests,
retried `storage.max_attempts` times). dcp-fsdp's control-plane calls (boto3 pre-flight,
listing, the small manifest and checksum objects, 2 attempts) are left alone, so a
run fails only where a test means it to.
"""

from __future__ import annotations

import collections
import http.client
import io
import re
import subprocess
import sys
import time

import boto3
import botocore.config
import botocore.exceptions
import pytest

from tests.kit.cli import REPO, clean_env, read_run, run_cli, s3_env
from tests.kit.fault_proxy import DATA_PLANE, FaultProxy, request_type

TIMEOUT_S = 180  # no CLI run in this file may take longer (they take 10-25 s)


def boto(s3, url: str, attempts: int = 1):
    return boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        config=botocore.config.Config(retries={"mode": "standard", "total_max_attempts": attempts},
                                      connect_timeout=5, read_timeout=30))


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]


# -- the proxy on its own ------------------------------------------------------------------

@pytest.mark.parametrize("method, target, headers, expected", [
    ("PUT", "/b/k?partNumber=3&uploadId=u", [], "UploadPart"),
    ("PUT", "/b/k?partNumber=3&uploadId=u", [("x-amz-copy-source", "b/j")], "UploadPartCopy"),
    ("PUT", "/b/dir/k", [], "PutObject"),
    ("PUT", "/b/k", [("X-Amz-Copy-Source", "b/j")], "CopyObject"),
    ("POST", "/b/k?uploads", [], "CreateMultipartUpload"),
    ("POST", "/b/k?uploadId=u", [], "CompleteMultipartUpload"),
    ("DELETE", "/b/k?uploadId=u", [], "AbortMultipartUpload"),
    ("DELETE", "/b/k", [], "DeleteObject"),
    ("POST", "/b?delete", [], "DeleteObjects"),
    ("GET", "/b/k", [("Range", "bytes=0-9")], "GetObjectRanged"),
    ("GET", "/b/k", [], "GetObject"),
    ("GET", "/b?list-type=2&prefix=x", [], "ListObjectsV2"),
    ("GET", "/b/k?uploadId=u", [], "ListParts"),
    ("HEAD", "/b/k", [], "HeadObject"),
    ("HEAD", "/b", [], "HeadBucket"),
    ("PUT", "/b", [], "CreateBucket"),
])
def test_request_types(method, target, headers, expected):
    assert request_type(method, target, headers) == expected


def test_requests_pass_through_signed_and_byte_exact(s3):
    """SigV4 (SeaweedFS checks it) survives the proxy; keep-alive and 100-continue work."""
    data = bytes(range(256)) * 20_000 + b"tail"  # ~5 MiB
    with FaultProxy(s3.endpoint_url, targets=None) as proxy:
        proxy.record_timeline()
        client = boto(s3, proxy.url)
        before_s = time.time()
        client.put_object(Bucket=s3.bucket, Key="fp/pass/one", Body=data)
        after_s = time.time()
        client.upload_fileobj(io.BytesIO(data * 3), s3.bucket, "fp/pass/multi",
                              Config=boto3.s3.transfer.TransferConfig(
                                  multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20,
                                  max_concurrency=2))
        assert client.get_object(Bucket=s3.bucket, Key="fp/pass/one")["Body"].read() == data
        ranged = client.get_object(Bucket=s3.bucket, Key="fp/pass/multi", Range="bytes=7-99999")
        assert ranged["Body"].read() == (data * 3)[7:100000]
        client.head_object(Bucket=s3.bucket, Key="fp/pass/one")
        with pytest.raises(botocore.exceptions.ClientError) as missing:
            client.head_object(Bucket=s3.bucket, Key="fp/pass/none")
        assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        listed = client.list_objects_v2(Bucket=s3.bucket, Prefix="fp/pass/")
        assert {o["Key"] for o in listed["Contents"]} == {"fp/pass/one", "fp/pass/multi"}
        counts = proxy.counts
    # the timeline (an outside clock for the tool's timer): every exchange, in order, each
    # inside the client's own call
    timeline = proxy.timeline
    assert timeline is not None
    assert len(timeline) == sum(counts["requests"].values())
    put = timeline[0]
    assert (put.request_type, put.method) == ("PutObject", "PUT") and put.target.endswith("/fp/pass/one")
    assert put.end_s is not None and before_s <= put.head_s <= put.end_s <= after_s
    assert all(e.end_s is not None and e.head_s <= e.end_s for e in timeline)
    assert counts["requests"]["UploadPart"] == 3
    assert counts["requests"]["CreateMultipartUpload"] == 1
    assert counts["requests"]["CompleteMultipartUpload"] == 1
    assert counts["requests"]["GetObjectRanged"] == 1 and counts["requests"]["GetObject"] == 1
    assert counts["requests"]["HeadObject"] == 2 and counts["requests"]["ListObjectsV2"] == 1
    assert counts["expect_continue"].get("PutObject") == 1  # boto3 asks; relayed
    assert proxy.injected() == dict.fromkeys(("503", "500", "reset", "stall", "latency", "redirect"), 0)


def test_each_fault_reaches_the_client_as_s3_would_send_it(s3):
    with FaultProxy(s3.endpoint_url, targets=None) as proxy:
        client = boto(s3, proxy.url)
        client.put_object(Bucket=s3.bucket, Key="fp/faults/obj", Body=b"x" * 300_000)
        connections = proxy.connections

        proxy.error_503_rate = 1.0
        for call in (lambda: client.put_object(Bucket=s3.bucket, Key="fp/faults/b", Body=b"y" * 1000),
                     lambda: client.get_object(Bucket=s3.bucket, Key="fp/faults/obj"),
                     lambda: client.head_object(Bucket=s3.bucket, Key="fp/faults/obj")):
            with pytest.raises(botocore.exceptions.ClientError) as throttled:
                call()
            assert throttled.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert throttled.value.response["Error"]["Code"] in ("SlowDown", "503")  # HEAD: no body
        with pytest.raises(botocore.exceptions.ClientError) as throttled:
            client.list_objects_v2(Bucket=s3.bucket, Prefix="fp/")
        assert throttled.value.response["Error"]["Code"] == "SlowDown"
        assert throttled.value.response["Error"]["Message"] == "Please reduce your request rate."
        assert proxy.connections == connections  # a 503 keeps the connection alive

        proxy.error_503_rate, proxy.error_500_rate = 0.0, 1.0
        with pytest.raises(botocore.exceptions.ClientError) as failed:
            client.list_objects_v2(Bucket=s3.bucket, Prefix="fp/")
        assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
        assert failed.value.response["Error"]["Code"] == "InternalError"
        assert proxy.connections == connections  # so does a 500

        proxy.error_500_rate, proxy.reset_rate = 0.0, 1.0
        with pytest.raises(botocore.exceptions.ConnectionClosedError):  # PUT cut mid-body
            client.put_object(Bucket=s3.bucket, Key="fp/faults/c", Body=b"z" * 200_000)
        response = client.get_object(Bucket=s3.bucket, Key="fp/faults/obj")  # head arrives
        with pytest.raises((botocore.exceptions.ResponseStreamingError,
                            botocore.exceptions.IncompleteReadError)):
            response["Body"].read()  # body cut half-way
        proxy.reset_rate = 0.0
        # The cut PUT never reached the server; the connection pool recovers.
        with pytest.raises(botocore.exceptions.ClientError):
            client.head_object(Bucket=s3.bucket, Key="fp/faults/c")
        assert client.get_object(Bucket=s3.bucket, Key="fp/faults/obj")["Body"].read() == b"x" * 300_000
        injected, counts = proxy.injected(), proxy.counts
    assert injected["503"] == 4 and injected["500"] == 1 and injected["reset"] == 2
    assert counts["503"] == {"PutObject": 1, "GetObject": 1, "HeadObject": 1, "ListObjectsV2": 1}
    assert counts["reset"] == {"PutObject": 1, "GetObject": 1}
    assert [e.kind for e in proxy.events] == ["503"] * 4 + ["500"] + ["reset"] * 2


def test_decisions_are_seeded_per_request_type(s3):
    def pattern(seed: int) -> str:
        with FaultProxy(s3.endpoint_url, error_503_rate=0.5, seed=seed,
                        targets=["HeadObject"]) as proxy:
            client = boto(s3, proxy.url)
            client.put_object(Bucket=s3.bucket, Key="fp/seed", Body=b"s")
            outcome = ""
            for _ in range(24):
                try:
                    client.head_object(Bucket=s3.bucket, Key="fp/seed")
                    outcome += "."
                except botocore.exceptions.ClientError:
                    outcome += "5"
            assert proxy.counts["503"].get("HeadObject", 0) == outcome.count("5")
            assert "PutObject" not in proxy.counts["503"]  # not a target
            return outcome

    first = pattern(seed=7)
    assert pattern(seed=7) == first
    assert "5" in first and "." in first
    assert pattern(seed=8) != first


def test_stall_holds_then_forwards_and_latency_delays(s3):
    with FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=1.0, targets=["HeadBucket"]) as proxy:
        client = boto(s3, proxy.url)
        started = time.monotonic()
        client.head_bucket(Bucket=s3.bucket)
        assert 1.0 <= time.monotonic() - started < 5
        assert proxy.counts["stall"] == {"HeadBucket": 1}
        proxy.stall_rate, proxy.latency_s = 0.0, 0.3
        started = time.monotonic()
        client.head_bucket(Bucket=s3.bucket)
        assert 0.3 <= time.monotonic() - started < 3
        assert proxy.counts["latency"] == {"HeadBucket": 1}
    # A long stall ends when the proxy stops: nothing outlives the test.
    proxy = FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=600, targets=None).start()
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    connection.request("HEAD", f"/{s3.bucket}")
    time.sleep(0.3)
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 6
    connection.close()


def test_bucket_region_mode_redirects_like_aws(s3):
    """A request signed for another region: 301, x-amz-bucket-region, PermanentRedirect."""
    def signed_for(region: str) -> dict[str, str]:
        return {"Authorization": f"AWS4-HMAC-SHA256 Credential={s3.access_key_id}/20261122/"
                                 f"{region}/s3/aws4_request, SignedHeaders=host, Signature=00"}

    with FaultProxy(s3.endpoint_url, bucket_region="eu-west-2") as proxy:
        for method in ("GET", "HEAD"):
            connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            connection.request(method, f"/{s3.bucket}?list-type=2", headers=signed_for("us-east-1"))
            response = connection.getresponse()
            body = response.read()
            assert response.status == 301
            assert response.getheader("x-amz-bucket-region") == "eu-west-2"
            if method == "GET":
                assert b"<Code>PermanentRedirect</Code>" in body
                assert b"<Endpoint>" + s3.bucket.encode() + b".s3.eu-west-2.amazonaws.com" in body
            connection.close()
        # Signed for the bucket's region: forwarded (SeaweedFS then judges the signature).
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        connection.request("HEAD", f"/{s3.bucket}", headers=signed_for("eu-west-2"))
        assert connection.getresponse().status != 301
        connection.close()
        assert proxy.counts["redirect"] == {"ListObjectsV2": 1, "HeadBucket": 1}


# -- the tool through the proxy --------------------------------------------------------------

def test_save_and_load_absorb_503s_and_resets(s3, s3_uri, tmp_path):
    """10 % of UploadParts and ranged GETs answered 503 SlowDown, 2 % reset mid-body.

    Seed 5 makes the first UploadParts and GETs include both kinds (decisions are
    drawn per request type, so the n-th request of a type always gets the same one)."""
    with FaultProxy(s3.endpoint_url, error_503_rate=0.10, reset_rate=0.02, seed=5,
                    targets=DATA_PLANE) as proxy:
        result = run_cli(["save-and-load", f"storage.uri={s3_uri}",
                          f"storage.endpoint={proxy.url}", "nproc=2", "iterations=2",
                          f"results_dir={tmp_path}"], env=s3_env(s3), timeout_s=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not error_lines(result)
    counts = proxy.counts
    assert counts["503"].get("UploadPart", 0) >= 1 and counts["503"].get("GetObjectRanged", 0) >= 1
    assert counts["reset"].get("UploadPart", 0) >= 1 and counts["reset"].get("GetObjectRanged", 0) >= 1
    assert set(counts["503"]) | set(counts["reset"]) <= set(DATA_PLANE)

    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["error"] is None
    # Every iteration saved and loaded on both ranks, verified bit-exact by the tool itself.
    assert sorted((s["op"], s["iteration"], s["rank"]) for s in samples) == sorted(
        (op, it, rank) for op in ("save", "load") for it in (1, 2) for rank in (0, 1))
    assert all(s["bytes"] > 0 for s in samples)
    assert len(run["suffixes"]) == 2
    assert all(entry["checked"] for entry in run["integrity"].values())

    # request_stats is on by default: every sample carries the connector's own per-request
    # log, which sees what the proxy injected: every 503 is a throttled attempt, and each
    # 503 or cut upload was retried.
    assert all(isinstance(s.get("requests"), dict) for s in samples), samples
    windows = [s["requests"] for s in samples] + [run.get("untimed_requests") or {}]
    throttled = sum(w.get("throttled", 0) for w in windows)
    retries = sum(w.get("retries", 0) for w in windows)
    injected_503 = sum(counts["503"].values())
    assert throttled == injected_503, (throttled, counts)
    assert retries >= injected_503 + counts["reset"].get("UploadPart", 0), (retries, counts)
    assert sum(w.get("failed", 0) for w in windows) >= injected_503


def test_region_that_does_not_match_the_bucket_fails_in_seconds(s3, s3_uri, tmp_path):
    """The bucket "lives" in eu-west-2 (the proxy answers like AWS); the user says us-east-1.
    The pre-flight names the setting and the right value, before any rank starts work."""
    with FaultProxy(s3.endpoint_url, bucket_region="eu-west-2") as proxy:
        started = time.monotonic()
        result = run_cli(["save", f"storage.uri={s3_uri}", f"storage.endpoint={proxy.url}",
                          "storage.region=us-east-1", "nproc=2", f"results_dir={tmp_path}"],
                         env=s3_env(s3), timeout_s=TIMEOUT_S)
        elapsed_s = time.monotonic() - started
    assert result.returncode == 2, result.stdout + result.stderr
    assert error_lines(result) == [
        f"dcp-fsdp: error: storage.region=us-east-1: bucket '{s3.bucket}' is in eu-west-2; "
        "set storage.region=eu-west-2"], result.stderr
    assert elapsed_s < 15
    assert proxy.counts["redirect"].get("HeadBucket", 0) >= 1
    assert not list(tmp_path.glob("*.jsonl")) or read_run(tmp_path)[0]["status"] != "ok"


@pytest.mark.parametrize("fault, attempts, cause", [
    ("503", 2, "503 SlowDown"),
    ("reset", 1, "connection to S3 failed"),
])
def test_exhausted_retries_fail_with_one_clear_line(s3, s3_uri, tmp_path, fault, attempts, cause):
    error_503_rate, reset_rate = (1.0, 0.0) if fault == "503" else (0.0, 1.0)
    with FaultProxy(s3.endpoint_url, targets=["UploadPart"], error_503_rate=error_503_rate,
                    reset_rate=reset_rate) as proxy:
        result = run_cli(["save-and-load", f"storage.uri={s3_uri}",
                          f"storage.endpoint={proxy.url}", "nproc=2",
                          f"storage.max_attempts={attempts}", f"results_dir={tmp_path}"],
                         env=s3_env(s3), timeout_s=TIMEOUT_S)
    assert result.returncode != 0
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr
    assert cause in errors[0] and "retries exhausted" in errors[0], errors[0]
    assert "storage.max_attempts" in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert result.elapsed_s < 60, f"took {result.elapsed_s:.1f} s"
    counts = proxy.counts
    # Every UploadPart attempt got the fault; none reached the server.
    assert counts[fault].get("UploadPart", 0) == counts["requests"]["UploadPart"] >= attempts
    run, samples = read_run(tmp_path)
    assert run["status"] == "failed"
    assert cause in run["error"]
    assert not [s for s in samples if s["op"] == "save"]


@pytest.mark.parametrize("client", ["s3torchconnector", "fsspec", "msc"])
@pytest.mark.parametrize("op", ["save", "load"])
def test_a_server_that_answers_500_is_named_first_with_its_count(s3, s3_uri, tmp_path, client, op):
    """Every data object's request of the op answered 500 InternalError (a server whose volumes are
    full): the line and the record lead with what S3 answered, counted by the rank's request
    log as the proxy counted it, whatever the client's own error says (the connector's write
    into an upload its failed parts ended says only CRT error 14366, "request has already
    completed")."""
    kinds = ["UploadPart", "PutObject"] if op == "save" else ["GetObject", "GetObjectRanged"]
    settings = [f"storage.uri={s3_uri}", f"storage.client={client}", "nproc=1"]
    suffix = []
    if op == "load":  # the checkpoint saved straight to the server
        saved = run_cli(["save", *settings, f"storage.endpoint={s3.endpoint_url}",
                         f"results_dir={tmp_path / 'saved'}"], env=s3_env(s3), timeout_s=TIMEOUT_S)
        assert saved.returncode == 0, saved.stderr[-3000:]
        suffix = [f"suffix={read_run(tmp_path / 'saved')[0]['suffixes'][0]}"]
    attempts = ["storage.max_attempts=2"] if client == "s3torchconnector" else []
    with FaultProxy(s3.endpoint_url, targets=kinds, key_pattern=r"\.distcp$",
                    error_500_rate=1.0) as proxy:
        result = run_cli([op, *settings, *suffix, *attempts, f"storage.endpoint={proxy.url}",
                          f"results_dir={tmp_path / 'failed'}"], env=s3_env(s3),
                         timeout_s=TIMEOUT_S)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = error_lines(result)
    # the request log names a ranged GET GetObject; the proxy, GetObjectRanged
    answered: collections.Counter[str] = collections.Counter()
    for kind, count in proxy.counts["500"].items():
        answered[kind.removesuffix("Ranged")] += count
    said = re.match(r"dcp-fsdp: error: (S3 answered HTTP 500 to (?:all (\d+)|(\d+) of \d+) of "
                    r"rank 0's (\w+) attempts \(the server failed them)", line)
    assert said, line
    # what the rank counted is what the proxy answered (the "of" counts the .metadata GET too)
    assert int(said[2] or said[3]) == answered[said[4]] >= 1, (line, proxy.counts)
    run, _ = read_run(tmp_path / "failed")
    assert run["status"] == "failed" and run["error"].startswith(said[1]), run["error"]


def test_another_ranks_refused_writes_lead_rank_0s_line(s3, s3_uri, tmp_path):
    """Only rank 1's data objects answered 500: rank 0 says the line for the error every rank
    raises together, and its own request log saw no refusal; rank 1's answers cross to it inside
    DCP's exception (before: the bare CRT error 14366 and a guess at its cause)."""
    with FaultProxy(s3.endpoint_url, targets=["UploadPart", "PutObject"],
                    key_pattern=r"__1_\d+\.distcp$", error_500_rate=1.0) as proxy:
        result = run_cli(["save", f"storage.uri={s3_uri}", "nproc=2", "storage.max_attempts=2",
                          f"storage.endpoint={proxy.url}", f"results_dir={tmp_path}"],
                         env=s3_env(s3), timeout_s=TIMEOUT_S)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = error_lines(result)
    said = re.match(r"dcp-fsdp: error: (S3 answered HTTP 500 to all (\d+) of rank 1's UploadPart "
                    r"attempts \(the server failed them)", line)
    assert said, line
    assert int(said[2]) == proxy.counts["500"]["UploadPart"] >= 1, (line, proxy.counts)
    run, _ = read_run(tmp_path)
    assert run["status"] == "failed" and run["error"].startswith(said[1]), run["error"]


def test_stalled_response_ends_the_run_at_op_timeout(s3, s3_uri, tmp_path):
    op_timeout_s = 5
    with FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=600, targets=["UploadPart"]) as proxy:
        result = run_cli(["save-and-load", f"storage.uri={s3_uri}",
                          f"storage.endpoint={proxy.url}", "nproc=2",
                          f"op_timeout_s={op_timeout_s}", f"results_dir={tmp_path}"],
                         env=s3_env(s3), timeout_s=TIMEOUT_S)
        ended = time.monotonic()
        stalls = [e for e in proxy.events if e.kind == "stall"]
    assert result.returncode != 0
    assert stalls, proxy.counts
    # The watchdog starts with dcp.save, just before the first UploadPart stalls.
    after_first_stall = ended - stalls[0].mono_s
    assert after_first_stall < op_timeout_s + 6, f"ended {after_first_stall:.1f} s after the stall"
    assert any("op_timeout_s=5" in line for line in error_lines(result)), result.stderr
    run, _ = read_run(tmp_path)
    assert run["status"] == "failed" and "op_timeout_s" in run["error"]


def test_an_endpoint_killed_mid_save_is_named_first_with_the_fix(s3, s3_uri, tmp_path):
    """The S3 endpoint goes away while the ranks write (the proxy, which is the endpoint the
    run knows, stops: held connections cut, the port refused): the line and the record lead
    with the endpoint refusing connections and what to do, found by the rank's probe after
    DCP's own error (the connector's CRT error, or torch's "inline_container.cc ...
    unexpected pos" when a write fails mid-stream)."""
    proxy = FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=120,
                       targets=["PutObject", "CreateMultipartUpload", "UploadPart"],
                       key_pattern=r"\.distcp$").start()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "dcp_fsdp", "save", f"storage.uri={s3_uri}",
             f"storage.endpoint={proxy.url}", "model=tiny_llama", "nproc=2",
             "storage.max_attempts=2", f"results_dir={tmp_path}"],
            env=clean_env(s3_env(s3)), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        stderr, ended_s = _ended_after_endpoint_gone(process, proxy, "the save never wrote its data")
    except BaseException:
        proxy.stop()
        raise
    assert ended_s < 30  # storage.max_attempts=2: no long retries
    assert process.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    lead = (f"storage.endpoint={proxy.url}: cannot connect (EndpointConnectionError: "
            "connection refused); check the address and that the server is up")
    assert errors[0].startswith(f"dcp-fsdp: error: {lead} (found by probing the storage"), errors[0]
    run, _ = read_run(tmp_path)
    assert run["status"] == "failed" and run["error"].startswith(lead), run["error"]
    assert "inline_container" not in run["error"].split("(found by probing", 1)[0]
    # The launcher cannot look at the partial checkpoint either: it says why the same way.
    assert f"could not check the partial checkpoint ({lead})" in stderr, stderr


def _ended_after_endpoint_gone(process: subprocess.Popen, proxy: FaultProxy, never: str) -> tuple[str, float]:
    """Once the proxy has held the save's upload, stop it (its port refuses connections): the
    save's stderr and the seconds it ran on after."""
    assert proxy.wait_for_injection(process, TIMEOUT_S), never
    proxy.stop()
    killed = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return stderr, time.monotonic() - killed


def test_an_endpoint_killed_mid_save_under_fsspec_ends_the_run_in_seconds(s3, s3_uri, tmp_path):
    """Issue 49, late 1: a save under fsspec ended 23 s after its server's kill -9: s3fs's
    botocore ran the legacy mode's 5 attempts (up to 15 s of backoff) on each of the three
    requests a failed save makes one after another (the part, torch's clean-up of the object,
    s3fs's close). The endpoint (the proxy, holding the first part: a 5 MiB block makes the
    save multipart, as a large model's is) goes away; the run ends in seconds (standard mode:
    3 attempts, at most 3 s of backoff each: ~5 s, 9 s at worst) with the refused connection
    named, and the record says the retries it ran with."""
    proxy = FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=120, targets=["UploadPart"],
                       key_pattern=r"\.distcp$").start()
    env = clean_env(s3_env(s3))
    for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_CONFIG_FILE"):
        env.pop(name, None)  # botocore's defaults, not the developer's
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "dcp_fsdp", "save", f"storage.uri={s3_uri}",
             f"storage.endpoint={proxy.url}", "storage.client=fsspec", "storage.fsspec_block_size_mib=5",
             "model=tiny_llama", "nproc=1", f"results_dir={tmp_path}"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stderr, ended_s = _ended_after_endpoint_gone(process, proxy, "the save never uploaded a part")
    except BaseException:
        proxy.stop()
        raise
    assert process.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith(f"dcp-fsdp: error: storage.endpoint={proxy.url}: cannot connect "
                                "(EndpointConnectionError: connection refused)"), errors[0]
    run, _ = read_run(tmp_path)
    assert (run["storage"]["retry_mode"], run["storage"]["max_attempts"]) == ("standard", 3), run["storage"]
    # the attempts the rank's request statistics counted: 3 for each failed request (the held
    # part and s3fs's close each one UploadPart, torch's clean-up one DeleteObjects)
    by_type = run["untimed_requests"]["by_type"]
    failed = {name: counts["count"] for name, counts in by_type.items() if counts["failed"]}
    assert failed == {"UploadPart": 6, "DeleteObjects": 3}, by_type
    # 4.4-8.1 s on the 2-core VM (legacy: 17.9-34.4 s); room for a busy machine's teardown
    assert ended_s < 15, f"ended {ended_s:.1f} s after the endpoint went away"


def test_a_failed_load_never_says_its_checkpoint_was_checked(s3, s3_uri, tmp_path):
    """Issue 49 item 9: a load whose data GETs all fail ends with a failed record and no
    sample; its integrity must not say checked (it said `checked: true, reason: null`)."""
    save = run_cli(["save", f"storage.uri={s3_uri}", f"storage.endpoint={s3.endpoint_url}",
                    "nproc=1", "suffix=item9", f"results_dir={tmp_path / 'save'}"],
                   env=s3_env(s3), timeout_s=TIMEOUT_S)
    assert save.returncode == 0, save.stderr
    with FaultProxy(s3.endpoint_url, targets=["GetObject", "GetObjectRanged"],
                    key_pattern=r"\.distcp$", error_503_rate=1.0) as proxy:
        load = run_cli(["load", f"storage.uri={s3_uri}", f"storage.endpoint={proxy.url}",
                        "nproc=1", "suffix=item9", "storage.max_attempts=1",
                        f"results_dir={tmp_path / 'load'}"], env=s3_env(s3), timeout_s=TIMEOUT_S)
    assert load.returncode != 0 and proxy.injected().get("503"), load.stderr
    run, samples = read_run(tmp_path / "load")
    assert run["status"] != "ok" and not [s for s in samples if s["op"] == "load"]
    assert not any(entry.get("checked") for entry in run["integrity"].values()), run["integrity"]
