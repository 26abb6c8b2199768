"""Two saves, one suffix, one bucket: exactly one writes (storage/layout.py's claim).

A save claims its suffix (rank 0, before any rank writes) by a conditional write of
`<suffix>/dcp_fsdp.claim` (PutObject with If-None-Match: *). On SeaweedFS and moto, each a
real server on loopback: the support probe, an atomic race of in-process claims, and real
CLI saves with one suffix=: the first one's data held by the fault proxy, so the second
checks the suffix while the first is writing into it (before the claim, the second saw
nothing committed there and both wrote: a mixed checkpoint, both exit 0); the first one's
claim held, so both pass the check and the server's answer to two conditional PUTs
decides; and two started together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from unittest import mock

import botocore.exceptions
import pytest

from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.preflight import forget_aws_credentials
from dcp_fsdp.storage import layout, make_store
from tests.kit.cli import (REPO, clean_env, read_run, run_cli, s3_args, s3_client, s3_env,
                           start_cli, stop)
from tests.kit.fault_proxy import FaultProxy

# Requests that write an object: none may come from the save that is refused.
WRITES = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
          "CopyObject")


@pytest.fixture(params=["seaweedfs", "moto"])
def server(request):
    """(endpoint, a fresh s3:// prefix) on SeaweedFS (the session's) or moto (server mode)."""
    endpoint = request.getfixturevalue("s3" if request.param == "seaweedfs" else "moto_s3")
    return endpoint, f"s3://{endpoint.bucket}/claim-{uuid.uuid4().hex[:8]}"


def _store(endpoint, uri):
    """A store as a fresh process would make it: with the credentials in the environment
    now (boto3's default session keeps the first it read: the other server's, here)."""
    forget_aws_credentials()
    return make_store(StorageConfig(uri=uri, endpoint=endpoint.endpoint_url,
                                    region=endpoint.region))


def test_the_server_honours_if_none_match_and_the_probe_says_so(server):
    endpoint, uri = server
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    client = s3_client(endpoint)
    client.put_object(Bucket=bucket, Key=f"{prefix}/k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as second:
        client.put_object(Bucket=bucket, Key=f"{prefix}/k", Body=b"2", IfNoneMatch="*")
    assert second.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert second.value.response["Error"]["Code"] == "PreconditionFailed"
    with mock.patch.dict(os.environ, s3_env(endpoint)):
        store = _store(endpoint, uri)
        assert store.control.honours_if_none_match() is True
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert keys == [f"{prefix}/k"]  # the probe's object is gone


def test_of_claims_racing_for_one_suffix_exactly_one_wins(server):
    """8 stores (each its own boto3 client) claim one suffix at the same moment."""
    endpoint, uri = server
    with mock.patch.dict(os.environ, s3_env(endpoint)):
        stores = [_store(endpoint, uri) for _ in range(8)]
        for store in stores:
            store.control.honours_if_none_match()  # probed first: the race is the claim
        start, results = threading.Barrier(len(stores)), []

        def claim(store):
            start.wait()
            results.append(store.claim("race", f"{id(store)}".encode()))

        threads = [threading.Thread(target=claim, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(c.won for c in results) == [False] * 7 + [True]
    assert {c.method for c in results} == {layout.CLAIM_CONDITIONAL}


def test_a_probe_answered_500_is_the_error_not_an_ignored_condition(s3, s3_uri, capsys):
    """The probe's conditional PUT answered 500 InternalError on every attempt: that says
    nothing about If-None-Match, so it is the error (naming the status), never the warning
    that the server ignores the condition (a save would then claim its suffix non-atomically
    and record not_atomic)."""
    with (FaultProxy(s3.endpoint_url, targets=["PutObject"], key_pattern="claim-probe",
                     error_500_rate=1.0) as proxy,
          mock.patch.dict(os.environ, s3_env(s3))):
        store: Any = make_store(StorageConfig(uri=s3_uri, endpoint=proxy.url, region=s3.region))
        with pytest.raises(UserError, match="500"):
            store.control.honours_if_none_match()
    assert proxy.counts["500"]["PutObject"] >= 1
    assert "does not honour" not in capsys.readouterr().err


def test_a_server_that_ignores_the_condition_gets_the_stated_fallback(s3, s3_uri, capsys):
    """No server here ignores If-None-Match (both honour it): the probe's answer is set to
    'not honoured' to see the fallback: a check then a plain write, one warning line."""
    with mock.patch.dict(os.environ, s3_env(s3)):
        store = _store(s3, s3_uri)
        with mock.patch.object(store.control, "_put_if_absent", lambda key, data: True):
            assert store.control.honours_if_none_match() is False  # both PUTs "accepted"
        assert layout.save_suffix(store, "fallback", 1, 1, []) == (
            "fallback", layout.CLAIM_NOT_ATOMIC)
        assert store.has_objects("fallback")
        layout.save_suffix(store, None, 1, 1, [])  # the probe is not repeated, nor the line
    warnings = [line for line in capsys.readouterr().err.splitlines() if "If-None-Match" in line]
    assert len(warnings) == 1 and "not atomically" in warnings[0], warnings


def _save(endpoint_url: str, uri: str, results_dir, suffix: str,
          command: str = "save") -> list[str]:
    """A 1-rank save to `suffix`; command=save-and-load: then loaded by that same run, every
    value checked (its record's integrity[suffix]), once its save has committed."""
    return [command, f"storage.uri={uri}", f"storage.endpoint={endpoint_url}",
            "model=tiny_llama", "nproc=1", f"suffix={suffix}", f"results_dir={results_dir}"]


def _start_held_save(proxy: FaultProxy, uri: str, results_dir, suffix: str,
                     env: dict[str, str], command: str = "save") -> subprocess.Popen:
    """A save through `proxy` (stdout and stderr merged), returned once the proxy holds one
    of its requests; stopped, and the test failed, if it ends or takes 240 s first."""
    process = start_cli(_save(proxy.url, uri, results_dir, suffix, command), env)
    deadline = time.monotonic() + 240
    while not proxy.injected()["stall"]:
        if process.poll() is not None or time.monotonic() >= deadline:
            stop(process)
            raise AssertionError(f"the save never reached the held request:\n"
                                 f"{process.stdout.read() if process.stdout else ''}")
        time.sleep(0.2)
    return process


def test_two_saves_to_one_suffix_one_writes_the_other_is_refused_before_writing(
        server, tmp_path):
    endpoint, uri = server
    env = s3_env(endpoint)
    # The first save's data parts are held until the second has ended: it is writing
    # into the suffix, with nothing of it committed yet, while the second checks.
    with FaultProxy(endpoint.endpoint_url, stall_rate=1.0, stall_s=240,
                    targets=["UploadPart"]) as first_proxy, \
            FaultProxy(endpoint.endpoint_url) as second_proxy:
        # a save-and-load: the load, after the second has ended, checks every value
        first = _start_held_save(first_proxy, uri, tmp_path / "first", "race", env,
                                 "save-and-load")
        try:
            second = run_cli(_save(second_proxy.url, uri, tmp_path / "second", "race"), env=env)
            first_proxy.release_stalls()
            first_output = first.communicate(timeout=240)[0]
        finally:
            if first.poll() is None:
                stop(first)
        second_writes = {t: n for t, n in second_proxy.counts["requests"].items() if t in WRITES}
    assert first.returncode == 0, first_output
    assert second.returncode == 2, f"{second.returncode}\n{second.stdout}\n{second.stderr}"
    refusal = second.stderr.strip().splitlines()
    assert len(refusal) == 1 and "suffix=race:" in refusal[0], second.stderr
    assert "choose another suffix or omit it" in refusal[0]
    assert second_writes == {}, second_writes
    run, _ = read_run(tmp_path / "first")
    assert run["status"] == "ok" and run["suffix_claim"] == layout.CLAIM_CONDITIONAL

    bucket, prefix = uri[len("s3://"):].split("/", 1)
    client = s3_client(endpoint)
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    claim = client.get_object(Bucket=bucket, Key=f"{prefix}/race/{layout.CLAIM_NAME}")
    assert json.loads(claim["Body"].read())["run_id"] == run["run_id"]
    # The checkpoint is the first save's alone: it loads (the first run's own load, once
    # the second had ended), every value checked.
    assert run["suffixes"] == ["race"] and run["integrity"]["race"]["checked"] is True
    listing = run_cli(["list", *s3_args(endpoint, uri)], env=env)
    assert listing.returncode == 0 and "complete" in listing.stdout


def test_two_saves_started_at_once_on_seaweedfs_one_proceeds(s3, s3_uri, tmp_path):
    """The race as users meet it: both started together; whichever claims first writes (and
    loads it: both are save-and-load runs; the refused one loads nothing)."""
    env = clean_env(s3_env(s3))
    runs = [subprocess.Popen([sys.executable, "-m", "dcp_fsdp",
                              *_save(s3.endpoint_url, s3_uri, tmp_path / name, "same",
                                     "save-and-load")],
                             env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outputs = [run.communicate(timeout=300) for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 2], outputs
    refused = outputs[[run.returncode for run in runs].index(2)][1]
    assert "suffix=same:" in refused and "omit it to get a fresh one" in refused, refused
    winner = "ab"[[run.returncode for run in runs].index(0)]
    won, _ = read_run(tmp_path / winner)
    assert won["status"] == "ok" and won["integrity"]["same"]["checked"] is True


def test_two_saves_past_the_check_at_once_the_conditional_write_decides(server, tmp_path):
    """Both saves find the suffix empty: the first one's claim is held by the fault proxy
    until the second has claimed it, so the server receives two conditional PUTs of one
    key; the first is refused (412) by its launcher, which claims a configured suffix before
    it starts any rank (trial cases 16/18: it was rank 0's, after the ranks had started)."""
    endpoint, uri = server
    env = s3_env(endpoint)
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    client = s3_client(endpoint)
    claim_key = f"{prefix}/both/{layout.CLAIM_NAME}"
    with FaultProxy(endpoint.endpoint_url, stall_rate=1.0, stall_s=240, targets=["PutObject"],
                    key_pattern=rf"/both/{layout.CLAIM_NAME}$") as held:
        # the first save's claim is on its way
        first = _start_held_save(held, uri, tmp_path / "first", "both", env)
        second = None
        try:
            second = start_cli(_save(endpoint.endpoint_url, uri, tmp_path / "second", "both"),
                               env)
            deadline = time.monotonic() + 240
            while "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix=claim_key):
                assert second.poll() is None, second.communicate()
                assert time.monotonic() < deadline, "the second save never claimed"
                time.sleep(0.1)
            held.release_stalls()
            first_output = first.communicate(timeout=240)[0]
            second_output = second.communicate(timeout=240)[0]
        finally:
            for process in (first, second):
                if process is not None and process.poll() is None:
                    stop(process)
        first_writes = {t: n for t, n in held.counts["requests"].items()
                        if t in WRITES and t != "PutObject"}
    assert second.returncode == 0, second_output
    assert first.returncode == 2, first_output
    second_run, _ = read_run(tmp_path / "second")
    line = next(line for line in first_output.splitlines() if "error:" in line)
    assert "suffix=both: another save claimed it a moment ago" in line, first_output
    assert f"(run {second_run['run_id']} on host" in line and "this save wrote nothing" in line
    assert first_writes == {}, first_writes  # no data, no .metadata: only the refused claim
    # refused before any rank started: no rank's first line ("run R: save model=...")
    assert "save model=" not in first_output and "save model=" in second_output, first_output
    assert second_run["suffix_claim"] == layout.CLAIM_CONDITIONAL  # the launcher's, recorded
    claim = json.loads(client.get_object(Bucket=bucket, Key=claim_key)["Body"].read())
    assert claim["run_id"] == second_run["run_id"]
    loaded = run_cli(["load", *s3_args(endpoint, uri), "model=tiny_llama", "nproc=1",
                      "suffix=both", f"results_dir={tmp_path / 'load'}"], env=env)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert read_run(tmp_path / "load")[0]["integrity"]["both"]["checked"] is True
