"""Loads at another world size than the save: verified bit for bit, bytes as the model
holds them, corruption caught (real SeaweedFS, real ranks)."""

from __future__ import annotations

import boto3
import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def save(s3, s3_uri, tmp_path, nproc: int, *settings: str) -> str:
    result = run_cli(["save", *s3_args(s3, s3_uri), f"nproc={nproc}", *settings,
                      f"results_dir={tmp_path / 'save'}"], env=s3_env(s3))
    assert result.returncode == 0, result.stderr
    return read_run(tmp_path / "save")[0]["suffixes"][0]


def load(s3, s3_uri, tmp_path, suffix: str, nproc: int, *settings: str):
    result = run_cli(["load", *s3_args(s3, s3_uri), f"suffix={suffix}", f"nproc={nproc}",
                      *settings, f"results_dir={tmp_path / 'load'}"], env=s3_env(s3))
    return result, read_run(tmp_path / "load")


# 2 -> 1 with the optimizer covers the model's tensors too; 1 -> 2 the other direction
# (every load by suffix, here and elsewhere, is verified: test_async, test_moto).
@pytest.mark.parametrize("save_nproc, load_nproc, state", [
    (1, 2, "model"), (2, 1, "model_and_optimizer")])
def test_load_at_another_world_size_is_verified(s3, s3_uri, tmp_path, save_nproc, load_nproc,
                                                state):
    suffix = save(s3, s3_uri, tmp_path, save_nproc, f"state={state}", "seed=5")
    # the load's own seed differs: the checkpoint's manifest says which values to expect
    result, (run, samples) = load(s3, s3_uri, tmp_path, suffix, load_nproc, f"state={state}",
                                  "seed=6")
    assert result.returncode == 0, result.stderr
    assert run["world_size"] == load_nproc
    assert run["integrity"] == {suffix: {"checked": True, "reason": None}}
    loads = [s for s in samples if s["op"] == "load"]
    assert sorted(s["rank"] for s in loads) == list(range(load_nproc))
    # bytes: what the ranks' shards hold, together the whole checkpoint's state
    assert sum(s["bytes"] for s in loads) == run["model"]["state_bytes"]
    # fetched: what was read from storage for them, never less (more when a rank reads
    # whole stored tensors it holds only part of)
    assert all(s["fetched_bytes"] >= s["bytes"] for s in loads)
    if (save_nproc, load_nproc) == (1, 2):
        # each rank reads the saved tensors whole for half of them: 2x, said on the load's
        # own line of the end-of-run table
        amplification = sum(s["fetched_bytes"] for s in loads) / sum(s["bytes"] for s in loads)
        assert 1.9 < amplification < 2.2
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("| load ")]
        assert f"reads {amplification:.2f}x" in line


def test_corruption_is_detected_at_another_world_size(s3, s3_uri, tmp_path):
    suffix = save(s3, s3_uri, tmp_path, 2)
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
                          aws_access_key_id=s3.access_key_id,
                          aws_secret_access_key=s3.secret_access_key)
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{suffix}/")["Contents"]
    data_keys = sorted(obj["Key"] for obj in listed if obj["Key"].endswith(".distcp"))
    assert len(data_keys) == 2  # one object per saving rank
    body = bytearray(client.get_object(Bucket=bucket, Key=data_keys[1])["Body"].read())
    body[len(body) // 2] ^= 0x01  # one flipped bit, same size
    client.put_object(Bucket=bucket, Key=data_keys[1], Body=bytes(body))

    result, (run, _) = load(s3, s3_uri, tmp_path, suffix, 1)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1, result.stderr
    assert "integrity" in errors[0] and "corrupt" in errors[0] and "tensor 'model." in errors[0]
    assert run["status"] == "failed" and "integrity" in run["error"]


def test_integrity_false_loads_unchecked_and_says_so(s3, s3_uri, tmp_path):
    suffix = save(s3, s3_uri, tmp_path, 2)
    result, (run, _) = load(s3, s3_uri, tmp_path, suffix, 1, "integrity=false")
    assert result.returncode == 0, result.stderr
    assert run["integrity"] == {suffix: {"checked": False, "reason": "integrity=false"}}
