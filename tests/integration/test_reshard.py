"""Loads at another world size than the save: verified bit for bit, bytes as the model
holds them, corruption caught (real SeaweedFS, real ranks).

Two saves for the module (module fixture `saved`): one on 1 rank (model), one on 2 ranks
(model and AdamW state). Every test loads one of them at the other world size; the
corruption test loads a copy of the 2-rank one with one bit flipped, so the others' stays
whole."""

from __future__ import annotations

import pytest

from dcp_fsdp.storage.metadata_peek import screen
from tests.kit.cli import copy_checkpoint, read_run, run_cli, s3_args, s3_client, s3_env

SEED = "seed=5"
# the load's own seed differs: the checkpoint's manifest says which values to expect
LOAD_SEED = "seed=6"


def save(s3, s3_uri, results_dir, nproc: int, *settings: str) -> str:
    result = run_cli(["save", *s3_args(s3, s3_uri), f"nproc={nproc}", *settings,
                      f"results_dir={results_dir}"], env=s3_env(s3))
    assert result.returncode == 0, result.stderr
    return read_run(results_dir)[0]["suffixes"][0]


def load(s3, s3_uri, tmp_path, suffix: str, nproc: int, *settings: str):
    result = run_cli(["load", *s3_args(s3, s3_uri), f"suffix={suffix}", f"nproc={nproc}",
                      *settings, f"results_dir={tmp_path / 'load'}"], env=s3_env(s3))
    return result, read_run(tmp_path / "load")


@pytest.fixture(scope="module")
def saved(s3_server, tmp_path_factory):
    """{save world size: (uri, suffix, state)}: 1 rank with the model's state, 2 ranks with
    the model's and the optimizer's; each its own prefix."""
    s3 = s3_server.endpoint
    root = tmp_path_factory.mktemp("reshard")
    checkpoints = {}
    for nproc, state in ((1, "model"), (2, "model_and_optimizer")):
        uri = f"s3://{s3.bucket}/reshard-{nproc}"
        suffix = save(s3, uri, root / f"save-{nproc}", nproc, f"state={state}", SEED)
        checkpoints[nproc] = (uri, suffix, state)
    return checkpoints


# 2 -> 1 with the optimizer covers the model's tensors too; 1 -> 2 the other direction
# (every load by suffix, here and elsewhere, is verified: test_async, test_moto).
@pytest.mark.parametrize("save_nproc, load_nproc, state", [
    (1, 2, "model"), (2, 1, "model_and_optimizer")])
def test_load_at_another_world_size_is_verified(s3, saved, tmp_path, save_nproc, load_nproc,
                                                state):
    uri, suffix, saved_state = saved[save_nproc]
    assert saved_state == state
    result, (run, samples) = load(s3, uri, tmp_path, suffix, load_nproc, f"state={state}",
                                  LOAD_SEED)
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


def test_corruption_is_detected_at_another_world_size(s3, s3_uri, saved, tmp_path):
    """The 2-rank checkpoint copied under this test's prefix, one bit flipped in the middle
    of a model tensor's bytes in rank 1's object (the middle of the object may be optimizer
    state): the load on 1 rank fails naming a model tensor."""
    uri, suffix, state = saved[2]
    client = s3_client(s3)
    copy_checkpoint(client, uri, suffix, s3_uri)
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{suffix}/")["Contents"]
    data_keys = sorted(obj["Key"] for obj in listed if obj["Key"].endswith(".distcp"))
    assert len(data_keys) == 2  # one object per saving rank
    metadata = screen(client.get_object(Bucket=bucket, Key=f"{prefix}/{suffix}/.metadata")
                      ["Body"].read())
    object_name = data_keys[1].rsplit("/", 1)[1]
    model_items = [info for index, info in metadata.storage_data.items()
                   if index.fqn.startswith("model.") and info.relative_path == object_name]
    item = max(model_items, key=lambda info: info.length)
    body = bytearray(client.get_object(Bucket=bucket, Key=data_keys[1])["Body"].read())
    body[item.offset + item.length // 2] ^= 0x01  # one flipped bit, same size
    client.put_object(Bucket=bucket, Key=data_keys[1], Body=bytes(body))

    result, (run, _) = load(s3, s3_uri, tmp_path, suffix, 1, f"state={state}")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1, result.stderr
    assert "integrity" in errors[0] and "corrupt" in errors[0] and "tensor 'model." in errors[0]
    assert run["status"] == "failed" and "integrity" in run["error"]


def test_integrity_false_loads_unchecked_and_says_so(s3, saved, tmp_path):
    uri, suffix, state = saved[2]
    result, (run, _) = load(s3, uri, tmp_path, suffix, 1, f"state={state}", "integrity=false")
    assert result.returncode == 0, result.stderr
    assert run["integrity"] == {suffix: {"checked": False, "reason": "integrity=false"}}
