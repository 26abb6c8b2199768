"""S3 request statistics cross-checked on real runs: the record's counts against
SeaweedFS's own request counters, and against what a fault proxy injected."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

from dcp_fsdp.telemetry.connector_log import PARSER_FORMAT
from dcp_fsdp.telemetry.summaries import merge_summaries
from tests.kit.cli import read_run, run_cli, s3_args, s3_env
from tests.kit.request_lines import parse_lines
from tests.kit.seaweed_counters import parse_server_metrics, server_view

def _server_counts(s3_server) -> collections.Counter:
    return parse_server_metrics(s3_server.metrics_text(), s3_server.bucket)


def _settled_counts(s3_server) -> collections.Counter:
    """The server's counters once they stop moving (it updates them after answering)."""
    previous = _server_counts(s3_server)
    for _ in range(20):
        time.sleep(0.25)
        current = _server_counts(s3_server)
        if current == previous:
            return current
        previous = current
    return previous


def _client_view(run: dict, samples: list[dict]) -> tuple[collections.Counter, dict]:
    """What our record says was sent: connector requests (timed and untimed), boto3 calls."""
    timed = merge_summaries(s["requests"] for s in samples)
    assert timed is not None  # the samples carry request statistics
    untimed = run["untimed_requests"]
    view = server_view(timed["by_type"]) + server_view(untimed["by_type"],
                                                       untimed.get("control_plane"))
    return view, {"timed": timed, "untimed": untimed}


def test_request_counts_match_the_servers_own_counters(s3_server, s3, s3_uri, tmp_path):
    """A 2-rank save, then a 2-rank load, each with its own record; the connector's log
    plus the tool's counted boto3 calls must equal SeaweedFS's per-type, per-code counters.

    Documented differences, accounted for explicitly:
      - SeaweedFS names HEAD as GET, UploadPart as PUT, Create/Complete multipart as POST
        (tests.kit.seaweed_counters.SERVER_TYPE);
      - the launcher's pre-flight runs in the parent process, before any rank (not in
        any record): one HeadBucket per invocation, and for `load` one HeadObject of
        .metadata (check_loadable), then a GET of the manifest and of .metadata (the
        model / dtype / state compatibility check, launch/preflight.py) as well.
    """
    env = s3_env(s3)
    metrics = f"storage.metrics_url={s3.metrics_url}"  # the run checks itself (ServerCheck)
    before = _settled_counts(s3_server)
    save = run_cli(["save", *s3_args(s3, s3_uri), "nproc=2", f"results_dir={tmp_path / 'save'}",
                    metrics], env=env)
    assert save.returncode == 0, save.stdout + save.stderr
    save_run, save_samples = read_run(tmp_path / "save")
    suffix = save_run["suffixes"][0]
    middle = _settled_counts(s3_server)
    load = run_cli(["load", *s3_args(s3, s3_uri), "nproc=2", f"suffix={suffix}",
                    f"results_dir={tmp_path / 'load'}", "keep_request_log=true", metrics],
                   env=env)
    assert load.returncode == 0, load.stdout + load.stderr
    after = _settled_counts(s3_server)
    server = after - before
    load_run, load_samples = read_run(tmp_path / "load")

    save_view, save_parts = _client_view(save_run, save_samples)
    load_view, load_parts = _client_view(load_run, load_samples)
    # 2 x HeadBucket, 1 x HeadObject, 2 x GetObject (manifest, .metadata); the load's listing
    # of its objects (every data object whole, before any rank)
    launcher = collections.Counter({("GET", "200"): 2 + 1 + 2, ("LIST", "200"): 1})
    client = save_view + load_view + launcher
    print("\ntype   code  record(save+load+launcher)  server")
    for key in sorted(set(client) | set(server)):
        print(f"{key[0]:<6} {key[1]:<5} {client[key]:>26}  {server[key]:>6}")
    assert dict(sorted(client.items())) == dict(sorted(server.items())), (
        f"client {dict(sorted(client.items()))}\nserver {dict(sorted(server.items()))}")
    # storage.metrics_url: each run made the same check itself (its launcher's calls counted)
    for run, window in ((save_run, middle - before), (load_run, after - middle)):
        check = run["server_requests"]
        assert check["match"] and check["differences"] == {} and check["incomplete"] == [], check
        assert check["server"] == {f"{t} {c}": n for (t, c), n in sorted(window.items()) if n}
    assert "match the server's own counters" in save.stderr + save.stdout

    # What a 2-rank FSDP save of tiny_llama is made of (one file per rank, then .metadata).
    timed_save = save_parts["timed"]["by_type"]
    assert timed_save["CreateMultipartUpload"]["count"] == 3  # 2 data files + .metadata
    assert timed_save["CompleteMultipartUpload"]["count"] == 3
    assert timed_save["UploadPart"]["count"] >= 3
    assert timed_save["HeadObject"]["status"] == {"200": 1, "404": 3}  # 2 ranks + rename
    assert timed_save["CopyObject"]["count"] == 1 and timed_save["DeleteObject"]["count"] == 1
    assert save_parts["timed"]["failed"] == 0 and save_parts["timed"]["misses"] == 3
    assert save_parts["untimed"]["count"] == 0  # nothing through the connector outside
    assert set(save_parts["untimed"]["control_plane"]) >= {"ListObjectsV2", "PutObject"}
    timed_load = load_parts["timed"]["by_type"]
    assert set(timed_load) == {"GetObject"} and timed_load["GetObject"]["status"].keys() == {"206"}
    # the load's rank 0 checks the model against the launcher's screened read of .metadata
    # (handed over): no GET of its own outside the timer (the tool reads it once per run)
    assert "GetObject" not in load_parts["untimed"]["by_type"]

    # Per sample: timed requests line up with the timer, bytes with DCP's own counts.
    for sample in save_samples + load_samples:
        stats = sample["requests"]
        assert stats["count"] > 0 and stats["failed"] == 0 and stats["success_ratio"] == 1.0
        assert stats["seconds"] == pytest.approx(sample["end_wall_s"] - sample["begin_wall_s"])
        assert stats["req_per_s"] == pytest.approx(stats["count"] / stats["seconds"], rel=1e-3)
        assert stats["latency_ms"]["p50"] <= stats["latency_ms"]["p99"] <= stats["latency_ms"]["max"]
    for sample in save_samples:  # every object this rank uploaded: its tensors (+ .metadata)
        assert sample["bytes"] <= sample["requests"]["bytes_up"] < sample["bytes"] + 2**20
    for sample in load_samples:  # ranged GETs of this rank's share (+ .metadata)
        assert sample["bytes"] <= sample["requests"]["bytes_down"] < sample["bytes"] + 2**20
    total_state = load_run["model"]["state_bytes"]
    assert sum(s["requests"]["bytes_down"] for s in load_samples) >= total_state

    # keep_request_log=true kept each rank's raw lines next to the record.
    kept = sorted(Path(load_run["request_log_dir"]).glob("rank-*.log"))
    assert [p.name for p in kept] == ["rank-00000.log", "rank-00001.log"]
    raw = parse_lines(kept[0].read_text().splitlines())
    rank0 = [s for s in load_samples if s["rank"] == 0][0]
    # a request is its operation's when its meta request began inside it (request_log.py)
    inside = [r for r in raw if rank0["begin_wall_s"] <= r.at_s <= rank0["end_wall_s"]]
    # (the raw log may hold nothing else: rank 0's model check reads the launcher's facts)
    assert len(inside) == rank0["requests"]["count"] and len(raw) >= len(inside)
    assert "record: " in load.stdout and "requests" in load.stdout  # end-of-run table column
    assert not list((tmp_path / "save").glob("*.requests"))  # off by default

    # `dcp-fsdp report` over both records: a row per operation, the request columns filled.
    from dcp_fsdp.analysis import report

    result = report.build(*report.read_records(report.record_files([str(tmp_path)]))[:2])
    table = result["throughput"]
    assert list(table["op"]) == ["save", "load"] and set(table["nodes"]) == {1}
    for column in ("requests_per_op", "req_per_s"):
        assert (table[column] > 0).all(), column
    types = result["types"]  # latency per request type (never pooled across types)
    for column in ("latency_p50_ms", "latency_p99_ms"):
        assert (types[column] > 0).all(), column
    assert {"UploadPart", "GetObject"} <= set(types["request_type"])
    assert list(table["failures"]) == [0, 0] and list(table["throttles"]) == [0, 0]
    assert list(table["requests_per_op"]) == [timed_count(save_samples),
                                              timed_count(load_samples)]


def timed_count(samples: list[dict]) -> int:
    return sum(s["requests"]["count"] for s in samples)


def test_an_embedded_server_run_checks_its_request_counts_against_the_servers(tmp_path):
    """No storage configured: the embedded SeaweedFS's metrics URL is known, so the run
    compares its record's per-type counts with the server's counters by itself."""
    result = run_cli(["save-and-load", "nproc=1", "iterations=2", f"results_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout + result.stderr
    run, samples = read_run(tmp_path)
    check = run["server_requests"]
    assert run["config"]["storage"]["metrics_url"] == check["source"]
    assert check["match"], check
    assert check["record"] == check["server"] and check["server"]["PUT 200"] >= 4
    timed = merge_summaries(s["requests"] for s in samples)
    assert timed is not None and timed["unparsed"] == 0 and run["untimed_requests"]["late"] == 0
    assert {s["requests"]["parser"] for s in samples} == {PARSER_FORMAT}


def test_throttles_and_retries_match_what_a_fault_proxy_injected(s3, s3_uri, tmp_path):
    """503 SlowDown on ~30 % of data-plane requests (UploadPart, ranged GET): the record
    counts each one as a throttled, retried failure, and the run still succeeds."""
    from tests.kit import fault_proxy
    with fault_proxy.FaultProxy(s3.endpoint_url, error_503_rate=0.3, seed=7) as proxy:
        result = run_cli(["save-and-load", f"storage.uri={s3_uri}",
                          f"storage.endpoint={proxy.url}", f"results_dir={tmp_path}"],
                         env=s3_env(s3))
        injected = proxy.counts["503"]
    assert result.returncode == 0, result.stdout + result.stderr
    run, samples = read_run(tmp_path)
    timed = merge_summaries(s["requests"] for s in samples)
    assert sum(injected.values()) > 0
    assert timed is not None
    assert timed["throttled"] == sum(injected.values())
    assert timed is not None
    assert timed["by_type"]["UploadPart"]["throttled"] == injected.get("UploadPart", 0)
    assert timed is not None
    assert timed["by_type"]["GetObject"]["throttled"] == injected.get("GetObjectRanged", 0)
    assert timed is not None
    assert timed["retries"] == timed["throttled"] == timed["failed"]  # every one retried
    assert timed is not None
    assert timed["status"]["503"] == timed["throttled"]
    assert timed is not None
    assert timed["success_ratio"] == pytest.approx(1 - timed["failed"] / timed["count"])
    assert run["untimed_requests"]["failed"] == 0


def test_gets_cut_mid_body_are_retries_and_egress_is_what_came_down_the_wire(s3, s3_uri,
                                                                               tmp_path):
    """Issue 31 item 2, issue 47 item 6: the proxy cuts two ranged GETs of the load's data
    object after 3 MiB of their 8 MiB bodies; the CRT sends them again and the load
    succeeds. The record counts both as failed, retried attempts, and its egress is what
    the kernel received on the rank's sockets to the endpoint: what the proxy passed down,
    cut bodies included, within 2 % (before: the whole bodies only, the cut ones a bound
    the table stated)."""
    from tests.kit import fault_proxy
    cut_after_bytes = 3 * 2**20
    with fault_proxy.FaultProxy(s3.endpoint_url, reset_rate=1.0, max_resets=2,
                                reset_after_bytes=cut_after_bytes,
                                targets=("GetObjectRanged",), key_pattern=r"\.distcp$") as proxy:
        result = run_cli(["save-and-load", "model=tiny_llama", f"storage.uri={s3_uri}",
                          f"storage.endpoint={proxy.url}", f"results_dir={tmp_path}"],
                         env=s3_env(s3))
        counts = proxy.counts
    assert result.returncode == 0, result.stdout + result.stderr
    assert counts["reset"] == {"GetObjectRanged": 2}
    # the connector's GETs are all ranged; boto3's (the tool's own small objects) are not
    wire_bytes = counts["bytes_down"]["GetObjectRanged"]
    cut_bytes = counts["bytes_cut"]["GetObjectRanged"]
    assert cut_bytes == 2 * cut_after_bytes
    run, samples = read_run(tmp_path)
    load, = [s for s in samples if s["op"] == "load"]
    requests = load["requests"]
    assert (requests["failed"], requests["retries"]) == (2, 2)  # before: 0, 0
    assert requests["broken"] == 2
    assert run["untimed_requests"]["bytes_down"] == 0  # every GET in the load's window
    assert requests["bytes_down"] == wire_bytes - cut_bytes  # the connector's log: whole bodies
    assert abs(load["fetched_bytes"] - wire_bytes) <= 0.02 * wire_bytes
    assert requests["bytes_down_broken_max"] == 0  # nothing left uncounted
    row, = [line for line in result.stdout.splitlines() if line.startswith("| load ")]
    cells = [cell.strip() for cell in row.split("|")]
    header, = [line for line in result.stdout.splitlines() if line.startswith("| op ")]
    columns = [cell.strip() for cell in header.split("|")]
    assert cells[columns.index("egress MiB")] == f"{load['fetched_bytes'] / 2**20:.1f}"
    assert cells[columns.index("failed/throttled")] == "2/0"
    assert "2 GET(s) broke mid-body and were sent again (egress counts what came down)" in row
