"""A save that dies between claiming its suffix and writing its first object leaves a suffix
holding only `dcp_fsdp.claim`: not a checkpoint. The run's own aftermath removes it (when the
claim is the run's own); `list` names one left by anything else as CLAIMED, NO DATA with its
age and who claimed it, and `dcp-fsdp delete suffix=` removes it. On SeaweedFS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from unittest import mock


from dcp_fsdp import contract
from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.launch.preflight import forget_aws_credentials
from dcp_fsdp.storage import layout, make_store
from tests.kit.cli import REPO, clean_env, rank_pids, read_run, run_cli, s3_args, s3_env, s3_client
from tests.kit.fault_proxy import FaultProxy

# Every write of a checkpoint's own objects (data, .metadata, manifest), however sent;
# the claim, and the probes beside the checkpoints, pass.
OBJECT_WRITES = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
                 "CopyObject")
AFTER_THE_CLAIM = r"/(__\d+_\d+\.distcp|\.metadata(\.tmp)?|dcp_fsdp\.json)$"


def _keys(s3, uri: str, under: str = "") -> list[str]:
    client = s3_client(s3)
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{under}")
    return [obj["Key"][len(prefix) + 1:] for obj in listed.get("Contents", [])]


def test_a_save_killed_right_after_its_claim_leaves_no_suffix(s3, s3_uri, tmp_path):
    """Rank 0 is SIGKILLed once it has claimed its suffix and its first data write is held
    at the proxy: the launcher finds the suffix holding only this run's claim, removes it and
    says so in one line."""
    with FaultProxy(s3.endpoint_url, stall_rate=1.0, stall_s=300, targets=OBJECT_WRITES,
                    key_pattern=AFTER_THE_CLAIM) as proxy:
        process = subprocess.Popen(
            [sys.executable, "-m", "dcp_fsdp", "save", f"storage.uri={s3_uri}",
             f"storage.endpoint={proxy.url}", "model=tiny_llama", "nproc=1",
             f"results_dir={tmp_path}"],
            env=clean_env(s3_env(s3)), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            assert proxy.wait_for_injection(process, 180), "the save never wrote after its claim"
            claimed = _keys(s3, s3_uri)
            assert len(claimed) == 1 and claimed[0].endswith(f"/{layout.CLAIM_NAME}"), claimed
            os.kill(rank_pids(process.pid)[0], signal.SIGKILL)
            output = process.communicate(timeout=120)[0]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    suffix = claimed[0].split("/")[0]
    assert process.returncode == 1, output
    run, _ = read_run(tmp_path)
    assert run["status"] == "failed" and run["incomplete_suffix"] == suffix
    said = [line for line in output.splitlines() if f"suffix={suffix}" in line]
    assert len(said) == 1, output
    assert "held only this run's claim, no data" in said[0] and "removed" in said[0], said
    assert _keys(s3, s3_uri) == []
    listing = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert listing.returncode == 0 and suffix not in listing.stdout, listing.stdout


def test_list_names_an_abandoned_claim_and_delete_removes_it(s3, s3_uri, tmp_path):
    """A claim left by a run that is gone (its launcher killed too): `list` says what it is
    and how old; `delete` leaves a young one alone unless forced, then removes it."""
    with mock.patch.dict(os.environ, {**s3_env(s3), contract.RUN_ID_ENV: "gone-run"}):
        forget_aws_credentials()
        store = make_store(StorageConfig(uri=s3_uri, endpoint=s3.endpoint_url, region=s3.region))
        assert layout.save_suffix(store, "orphan", 1, 1, [])[0] == "orphan"
        store.put_small("half", "__0_0.distcp", b"data")  # an incomplete one, for contrast
    listing = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith("| orphan "))
    assert "CLAIMED, NO DATA (" in row and " s old)" in row, row
    assert "INCOMPLETE" in next(line for line in listing.stdout.splitlines()
                                if line.startswith("| half "))
    note = next(line for line in listing.stdout.splitlines() if line.startswith("suffix=orphan:"))
    assert "by run gone-run on host" in note and "abandoned claim" in note, note
    assert "`dcp-fsdp delete suffix=orphan --force`" in note  # it is young: delete needs it

    delete = [*s3_args(s3, s3_uri), "suffix=orphan"]
    young = run_cli(["delete", *delete], env=s3_env(s3))
    assert young.returncode == 2, young.stdout + young.stderr
    assert young.stderr.strip().count("\n") == 0 and "--force" in young.stderr, young.stderr
    assert "holds only a save's claim" in young.stderr
    assert _keys(s3, s3_uri, "orphan/") == [f"orphan/{layout.CLAIM_NAME}"]
    forced = run_cli(["delete", *delete, "--force"], env=s3_env(s3))
    assert forced.returncode == 0, forced.stderr
    assert "deleted suffix=orphan" in forced.stdout and "a claim with no data" in forced.stdout
    assert _keys(s3, s3_uri) == ["half/__0_0.distcp"]
    again = run_cli(["delete", *delete, "--force"], env=s3_env(s3))
    assert again.returncode == 2 and "nothing is stored" in again.stderr, again.stderr


def test_delete_removes_a_complete_checkpoint_whatever_its_age(s3, s3_uri, tmp_path):
    save = run_cli(["save", *s3_args(s3, s3_uri), "nproc=1", "suffix=done",
                    f"results_dir={tmp_path}"], env=s3_env(s3))
    assert save.returncode == 0, save.stderr
    assert read_run(tmp_path)[0]["suffixes"] == ["done"]
    deleted = run_cli(["delete", *s3_args(s3, s3_uri), "suffix=done"], env=s3_env(s3))
    assert deleted.returncode == 0, deleted.stderr
    assert "deleted suffix=done" in deleted.stdout and "(complete," in deleted.stdout
    assert _keys(s3, s3_uri) == []
