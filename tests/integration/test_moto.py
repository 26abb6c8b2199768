"""The same product paths against a second S3 implementation: moto in server mode
(tests/kit/moto_server.py, IAM auth on so SigV4 is checked), real ranks: 2 for the shared
checkpoint and its load by suffix, one for the corrupted load (a resharded one: its rank
reads both ranks' objects) and the 503s (a single rank's requests meet the seeded faults).

Every other integration test runs against SeaweedFS; S3-compatible servers differ in
error bodies, status codes and multipart behaviour (README: "S3 servers we test
against"). Tiny models only: moto keeps every object in this process's memory and is
slow past ~100 MB. One checkpoint (2 saves) is shared by the module's tests.
"""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env, s3_client
from tests.kit.fault_proxy import DATA_PLANE, FaultProxy

TIMEOUT_S = 180


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert not error_lines(result)


def assert_refused(result, *fragments, within_s=15.0):
    """Our one-line error (exit 2) in seconds, before any rank works."""
    assert result.returncode == 2, result.stdout + result.stderr
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert result.elapsed_s < within_s, f"took {result.elapsed_s:.1f} s"


def data_keys(client, bucket, prefix) -> list[str]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".distcp"))


@pytest.fixture(scope="module")
def saved(moto_s3, tmp_path_factory):
    """2 saves of tiny_llama on 2 ranks: (uri, save record, save samples)."""
    uri = f"s3://{moto_s3.bucket}/moto-saved"
    results = tmp_path_factory.mktemp("moto-save")
    result = run_cli(["save", *s3_args(moto_s3, uri), "nproc=2", "iterations=2",
                      f"results_dir={results}"], env=s3_env(moto_s3), timeout_s=TIMEOUT_S)
    assert_ok(result)
    run, samples = read_run(results)
    return uri, run, samples


def test_save_records_on_moto(saved):
    uri, run, samples = saved
    assert run["status"] == "ok" and run["error"] is None and run["world_size"] == 2
    assert run["storage"]["kind"] == "s3" and run["storage"]["uri"] == uri
    assert len(run["suffixes"]) == 2 and len(set(run["suffixes"])) == 2
    assert sorted((s["iteration"], s["rank"]) for s in samples) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    state_bytes = run["model"]["state_bytes"]
    for iteration in (1, 2):
        total = sum(s["bytes"] for s in samples if s["iteration"] == iteration)
        assert state_bytes <= total < state_bytes * 1.01
    # The connector's request log, classified, on this server: multipart uploads, the
    # .metadata written then copied into place, HEADs that miss (404, not 403) before a
    # write; nothing failed or retried.
    for s in samples:
        requests = s["requests"]
        assert requests["failed"] == 0 and requests["retries"] == 0 and requests["throttled"] == 0
        assert requests["by_type"]["UploadPart"]["status"] == {"200": requests["by_type"]["UploadPart"]["count"]}
        assert set(requests["status"]) <= {"200", "204", "404"}
    by_type_rank0 = samples[0]["requests"]["by_type"]
    assert by_type_rank0["CopyObject"]["status"] == {"200": 1}
    assert by_type_rank0["HeadObject"]["misses"] >= 1


def test_list_and_load_by_suffix_verified(moto_s3, saved, tmp_path):
    uri, save_run, save_samples = saved
    listing = run_cli(["list", *s3_args(moto_s3, uri)], env=s3_env(moto_s3))
    assert_ok(listing)
    rows = [[cell.strip() for cell in line.split("|")[1:3]]
            for line in listing.stdout.splitlines() if line.startswith("| 20")]
    # (another test in this module adds an incomplete suffix under the same prefix)
    assert sorted(suffix for suffix, state in rows if state == "complete") == sorted(save_run["suffixes"])

    suffix = save_run["suffixes"][1]
    load = run_cli(["load", *s3_args(moto_s3, uri), f"suffix={suffix}", "nproc=2",
                    f"results_dir={tmp_path}"], env=s3_env(moto_s3), timeout_s=TIMEOUT_S)
    assert_ok(load)
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["suffixes"] == [suffix]
    assert run["integrity"] == {suffix: {"checked": True, "reason": None}}
    assert sum(s["bytes"] for s in samples) == sum(
        s["bytes"] for s in save_samples if s["iteration"] == 2)
    for s in samples:
        assert s["requests"]["failed"] == 0 and s["requests"]["bytes_down"] > 0


def test_corrupted_object_fails_the_load_naming_integrity(moto_s3, saved, tmp_path):
    uri, save_run, _ = saved
    suffix = save_run["suffixes"][0]
    client = s3_client(moto_s3)
    prefix = uri.split("/", 3)[3]
    keys = data_keys(client, moto_s3.bucket, f"{prefix}/{suffix}/")
    assert len(keys) == 2  # one file per rank
    body = bytearray(client.get_object(Bucket=moto_s3.bucket, Key=keys[1])["Body"].read())
    body[len(body) // 2] ^= 0xFF  # one flipped byte, same size
    client.put_object(Bucket=moto_s3.bucket, Key=keys[1], Body=bytes(body))

    # (one rank: it reads both objects, the flipped one included)
    load = run_cli(["load", *s3_args(moto_s3, uri), f"suffix={suffix}", "nproc=1",
                    f"results_dir={tmp_path}"], env=s3_env(moto_s3), timeout_s=TIMEOUT_S)
    assert load.returncode == 1, load.stdout + load.stderr
    errors = error_lines(load)
    assert len(errors) == 1, load.stderr
    assert "integrity" in errors[0] and "corrupt" in errors[0] and "tensor 'model." in errors[0]
    run, _ = read_run(tmp_path)
    assert run["status"] == "failed" and "integrity" in run["error"]


def test_incomplete_and_missing_checkpoints_are_refused(moto_s3, saved, tmp_path):
    """HEAD of .metadata answers 404 on moto too: no .metadata means not loadable."""
    uri, save_run, _ = saved
    client = s3_client(moto_s3)
    prefix = uri.split("/", 3)[3]
    # A copy of the first checkpoint's data objects without its .metadata: a save that died.
    for key in data_keys(client, moto_s3.bucket, f"{prefix}/{save_run['suffixes'][0]}/"):
        client.copy_object(Bucket=moto_s3.bucket, CopySource={"Bucket": moto_s3.bucket, "Key": key},
                           Key=key.replace(save_run["suffixes"][0], "2020-01-01-00-00-dead"))
    result = run_cli(["load", *s3_args(moto_s3, uri), "suffix=2020-01-01-00-00-dead", "nproc=2",
                      f"results_dir={tmp_path / 'incomplete'}"], env=s3_env(moto_s3))
    assert_refused(result, "suffix=2020-01-01-00-00-dead", "is incomplete", save_run["suffixes"][1])
    result = run_cli(["load", *s3_args(moto_s3, uri), "suffix=2020-01-01-00-00-none", "nproc=2",
                      f"results_dir={tmp_path / 'missing'}"], env=s3_env(moto_s3))
    assert_refused(result, "suffix=2020-01-01-00-00-none", "does not exist", save_run["suffixes"][1])


def test_missing_bucket_and_wrong_credentials_give_one_line(moto_s3, tmp_path):
    result = run_cli(["save", *s3_args(moto_s3, "s3://no-such-bucket/x"), "nproc=2",
                      f"results_dir={tmp_path / 'bucket'}"], env=s3_env(moto_s3))
    assert_refused(result, "storage.uri=s3://no-such-bucket/x", "does not exist")
    assert not list((tmp_path / "bucket").glob("*.jsonl"))

    env = {**s3_env(moto_s3), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = run_cli(["save", *s3_args(moto_s3, f"s3://{moto_s3.bucket}/x"), "nproc=2",
                      f"results_dir={tmp_path / 'keys'}"], env=env)
    assert_refused(result, "refused the credentials", "AWS_SECRET_ACCESS_KEY")
    assert "not-the-secret" not in result.stdout + result.stderr


def test_save_and_load_absorb_503s_through_the_fault_proxy(moto_s3, moto_uri, tmp_path):
    """20 % of UploadParts and ranged GETs answered 503 SlowDown in front of moto: the run
    completes, verified, and the records count each injected 503 as a throttled retry.
    One rank: its requests reach the seeded 503s (the 2nd UploadPart, the 5th ranged GET)."""
    with FaultProxy(moto_s3.endpoint_url, error_503_rate=0.20, seed=5,
                    targets=DATA_PLANE) as proxy:
        result = run_cli(["save-and-load", f"storage.uri={moto_uri}",
                          f"storage.endpoint={proxy.url}", "nproc=1", f"results_dir={tmp_path}"],
                         env=s3_env(moto_s3), timeout_s=TIMEOUT_S)
    assert_ok(result)
    injected = proxy.counts["503"]
    assert injected.get("UploadPart", 0) >= 1 and injected.get("GetObjectRanged", 0) >= 1, injected

    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["error"] is None
    assert sorted((s["op"], s["rank"]) for s in samples) == [("load", 0), ("save", 0)]
    assert all(entry["checked"] for entry in run["integrity"].values())
    windows = [s["requests"] for s in samples] + [run.get("untimed_requests") or {}]
    assert sum(w.get("throttled", 0) for w in windows) == sum(injected.values())
    assert sum(w.get("retries", 0) for w in windows) >= sum(injected.values())
