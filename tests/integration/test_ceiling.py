"""The raw ceiling (rank/ceiling.py) and request_stats=false: real 2-rank runs on SeaweedFS."""

from __future__ import annotations

import posixpath
from pathlib import Path

import boto3
import botocore.config

from tests.kit.cli import read_run, run_cli, s3_args, s3_env

OBJECT_STARTS = ("CreateMultipartUpload", "PutObject")  # one per object written
# every op a ceiling=true run records beside its DCP ones (rank/ceiling.py)
CEILING_OPS = {"raw_put", "raw_get", "raw_get_tensors", "raw_put_tensors", "mem_save", "mem_load",
               "tc_save"}
HEADROOM_LOAD = "ra_load"  # the tool's reader over the run's checkpoint (none without one)


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def boto(s3):
    return boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region,
                        aws_access_key_id=s3.access_key_id,
                        aws_secret_access_key=s3.secret_access_key,
                        config=botocore.config.Config(s3={"addressing_style": "path"}))


def all_keys(client, bucket: str, prefix: str = "") -> dict[str, int]:
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def objects_started(sample) -> int:
    by_type = sample["requests"]["by_type"]
    return sum(by_type.get(kind, {}).get("count", 0) for kind in OBJECT_STARTS)


def test_ceiling_moves_each_ranks_saved_objects_raw_and_removes_them(s3, s3_uri, tmp_path):
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "nproc=2", "ceiling=true",
                      "storage.thread_count=2", f"results_dir={tmp_path}"], env=s3_env(s3))
    assert_ok(result)
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok"
    (suffix,) = run["suffixes"]
    prefix = s3_uri.split("/", 3)[3]
    client = boto(s3)
    checkpoint = all_keys(client, s3.bucket, f"{prefix}/{suffix}/")
    for rank in (0, 1):
        mine = {k: v for k, v in checkpoint.items()
                if posixpath.basename(k).startswith(f"__{rank}_") and k.endswith(".distcp")}
        assert len(mine) == 2  # thread_count=2: two objects per rank
        by_op = {s["op"]: s for s in samples if s["rank"] == rank}
        assert set(by_op) == {"save", "load", HEADROOM_LOAD, *CEILING_OPS}
        # the same bytes as the rank's save, in as many objects
        # (a save's `bytes` are checkpoint bytes; what it stored is `written_bytes`)
        assert by_op["raw_put"]["bytes"] == by_op["save"]["written_bytes"] == sum(mine.values())
        assert by_op["raw_get"]["bytes"] == by_op["save"]["written_bytes"]
        assert objects_started(by_op["raw_put"]) == len(mine)
        assert by_op["raw_get"]["requests"]["bytes_down"] == sum(mine.values())
        # storage into tensors: the same objects landed in a preallocated tensor, and PUT
        # again from the live tensors' bytes
        assert by_op["raw_get_tensors"]["requests"]["bytes_down"] == sum(mine.values())
        assert objects_started(by_op["raw_put_tensors"]) == len(mine)
        # DCP alone: the same dcp.save / dcp.load on tmpfs, split, and no request to S3
        for op in ("mem_save", "mem_load"):
            assert by_op[op]["bytes"] == by_op["save"]["bytes"] and by_op[op]["plan_s"] > 0
        assert by_op["mem_load"]["storage_s"] >= 0 and by_op["mem_load"]["deserialise_s"] > 0
        assert by_op["mem_save"]["stage_s"] > 0
        for op in ("raw_put", "raw_get", "raw_get_tensors", "raw_put_tensors"):
            sample = by_op[op]
            assert sample["suffix"] == suffix and sample["iteration"] == 1
            assert 0 < sample["duration_s"] == sample["io_s"]
            assert sample["begin_wall_s"] < sample["end_wall_s"]
            assert sample["begin_wall_s"] >= by_op["load"]["end_wall_s"]  # after the DCP ops
    assert "load: DCP" in result.stdout and "storage into tensors" in result.stdout
    assert "load headroom: DCP's reader" in result.stdout and "save headroom:" in result.stdout
    assert not list(Path("/dev/shm").glob("dcp-fsdp-mem-*"))  # DCP alone's tmpfs removed
    # Nothing of the ceiling is left, and it never lay inside the checkpoints' prefix.
    leftovers = [k for k in all_keys(client, s3.bucket) if ".ceiling/" in k]
    assert leftovers == []
    assert all(k.startswith(f"{prefix}/{suffix}/") for k in all_keys(client, s3.bucket,
                                                                        f"{prefix}/"))
    listing = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert_ok(listing)
    assert suffix in listing.stdout and "ceiling" not in listing.stdout


def test_ceiling_command_alone_moves_the_planned_shards(s3, s3_uri, tmp_path):
    result = run_cli(["ceiling", *s3_args(s3, s3_uri), "nproc=2", "iterations=2",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    assert_ok(result)
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["command"] == "ceiling" and run["suffixes"] == []
    assert sorted((s["op"], s["iteration"], s["rank"]) for s in samples) == sorted(
        (op, i, r) for op in CEILING_OPS for i in (1, 2) for r in (0, 1))
    state_bytes = run["model"]["state_bytes"]
    for op in ("raw_put", "raw_get"):
        for iteration in (1, 2):
            total = sum(s["bytes"] for s in samples if s["op"] == op and s["iteration"] == iteration)
            # tensor bytes plus torch.save's framing, as a DCP save of the shards writes
            assert state_bytes < total < state_bytes * 1.01
    assert all(objects_started(s) == 1 for s in samples if s["op"] == "raw_put")
    prefix = s3_uri.split("/", 3)[3]
    assert all_keys(boto(s3), s3.bucket, prefix) == {}  # no checkpoint, no leftover
    assert "ceiling: 2 objects" in result.stdout


def test_request_stats_false_records_no_requests(s3, s3_uri, tmp_path):
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "nproc=1", "ceiling=true",
                      "request_stats=false", f"results_dir={tmp_path}"], env=s3_env(s3))
    assert_ok(result)
    run, samples = read_run(tmp_path)
    assert run["status"] == "ok" and run["untimed_requests"] is None
    assert {s["op"] for s in samples} == {"save", "load", HEADROOM_LOAD, *CEILING_OPS}
    assert all(s["requests"] is None for s in samples)
    assert all(row["untimed_request_count"] is None for row in run["init"])
    # the run table still prints (blank request columns)
    assert "raw_put" in result.stdout and "raw_get" in result.stdout


def test_fs_ceiling_writes_files_beside_the_checkpoints_and_removes_them(tmp_path):
    root = tmp_path / "ckpt"
    result = run_cli(["save-and-load", "storage=fs", f"storage.path={root}", "nproc=2",
                      "ceiling=true", "iterations=2", f"results_dir={tmp_path / 'results'}"])
    assert_ok(result)
    run, samples = read_run(tmp_path / "results")
    suffixes = run["suffixes"]
    assert len(suffixes) == 2
    for rank in (0, 1):
        by_op = {(s["op"], s["iteration"]): s for s in samples if s["rank"] == rank}
        files = sorted((root / suffixes[-1]).glob(f"__{rank}_*.distcp"))
        for iteration, suffix in enumerate(suffixes, start=1):
            # raw rows carry their own iteration's suffix (the DCP rows they pair with)
            assert by_op[("raw_put", iteration)]["suffix"] == suffix
            assert by_op[("raw_get", iteration)]["suffix"] == suffix
            assert by_op[("save", iteration)]["suffix"] == suffix
        assert by_op[("raw_put", 1)]["bytes"] == by_op[("raw_get", 1)]["bytes"] \
            == by_op[("save", 2)]["written_bytes"] == sum(f.stat().st_size for f in files)
        assert by_op[("raw_put", 1)]["requests"] is None
    assert not (tmp_path / "ckpt.ceiling").exists()
    assert sorted(p.name for p in root.iterdir()) == sorted(suffixes)


def test_a_resharded_load_with_a_ceiling_is_refused_before_any_rank(tmp_path):
    """The raw ceiling mirrors the saving ranks' objects rank for rank: at another world
    size it would measure a share of the bytes (issue 25, item 3). One line, no rank."""
    store = tmp_path / "store"
    save = run_cli(["save", "storage=fs", f"storage.path={store}", "nproc=1", "suffix=one",
                    f"results_dir={tmp_path / 's'}"])
    assert save.returncode == 0, save.stderr
    load = run_cli(["load", "storage=fs", f"storage.path={store}", "nproc=2", "suffix=one",
                    "ceiling=true", f"results_dir={tmp_path / 'l'}"])
    assert load.returncode == 2, load.stderr
    errors = [line for line in load.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1, load.stderr
    assert "ceiling=true: suffix=one was saved by 1 rank(s)" in errors[0] and "load with 1 ranks" in errors[0]
    assert not (tmp_path / "l").exists() or not list((tmp_path / "l").glob("*.jsonl"))


def test_a_run_killed_during_its_ceiling_leaves_no_upload_and_no_object(s3, s3_uri, tmp_path):
    """A rank SIGKILLed while the ceiling's raw PUT has a multipart upload open (its parts
    held at a proxy): the launcher aborts the upload and removes the run's raw area, which is
    named by the run (rank/ceiling.py, launch/aftermath.py)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.kit.cli import REPO, clean_env, rank_pids
    from tests.kit.fault_proxy import FaultProxy

    with FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=300, targets=("UploadPart",),
                    key_pattern=r"\.ceiling/") as proxy:
        process = subprocess.Popen(
            [sys.executable, "-m", "dcp_fsdp", "save", f"storage.uri={s3_uri}",
             f"storage.endpoint={proxy.url}", "model=tiny_llama", "nproc=1", "ceiling=true",
             "storage.part_size_mib=5", f"results_dir={tmp_path}"],
            env=clean_env(s3_env(s3)), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            assert proxy.wait_for_injection(process, 180), "the ceiling never uploaded a part"
            client = boto(s3)
            held = client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
            assert any(".ceiling/" in upload["Key"] for upload in held), held
            os.kill(rank_pids(process.pid)[0], signal.SIGKILL)
            output = process.communicate(timeout=120)[0]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 1, output
    left = client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert not [u for u in left if ".ceiling/" in u["Key"]], left
    assert [k for k in all_keys(client, s3.bucket) if ".ceiling/" in k] == []
    assert "open multipart upload(s) of this run's raw rounds aborted" in output, output
