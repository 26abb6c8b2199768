"""A checkpoint with a data object deleted or cut short is refused in one line naming the
object, before any rank builds the model (DCP would fail part way with "The key does not
exist" or "S3 stream exhausted"). Real objects on SeaweedFS and on a file system."""

from __future__ import annotations

import pickle
import shutil

from tests.kit.cli import read_run, run_cli, s3_args, s3_env, s3_client


def refused_line(result) -> str:
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_an_s3_checkpoint_missing_and_short_of_data_objects_is_refused_naming_them(s3, s3_uri, tmp_path):

    save = run_cli(["save", *s3_args(s3, s3_uri), "nproc=2", f"results_dir={tmp_path / 's'}"], env=s3_env(s3))
    assert save.returncode == 0, save.stderr
    suffix = read_run(tmp_path / "s")[0]["suffixes"][0]
    client = s3_client(s3)
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):  # a whole copy, for contrast
        client.copy_object(Bucket=bucket, Key=f"{prefix}/whole/{name}",
                           CopySource={"Bucket": bucket, "Key": f"{prefix}/{suffix}/{name}"})
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{suffix}/__1_0.distcp")
    cut = f"{prefix}/{suffix}/__0_0.distcp"
    body = client.get_object(Bucket=bucket, Key=cut)["Body"].read()
    client.put_object(Bucket=bucket, Key=cut, Body=body[: len(body) // 2])
    load = run_cli(["load", *s3_args(s3, s3_uri), f"suffix={suffix}", "nproc=2",
                    f"results_dir={tmp_path / 'l'}"], env=s3_env(s3))
    line = refused_line(load)
    assert f"suffix={suffix}: damaged checkpoint: data object __1_0.distcp is missing" in line
    assert "(and 1 more object(s) damaged)" in line
    assert load.elapsed_s < 30  # before any rank: no model build

    # `list` alone stays a listing (complete: it has .metadata); `list --check` reads each
    # complete checkpoint's .metadata and marks this one DAMAGED, naming the first object.
    plain = run_cli(["list", *s3_args(s3, s3_uri)], env=s3_env(s3))
    assert plain.returncode == 0 and _state(plain, suffix) == "complete", plain.stdout
    assert "`dcp-fsdp list --check` also checks each one's data objects" in plain.stdout
    checked = run_cli(["list", *s3_args(s3, s3_uri), "--check"], env=s3_env(s3))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert _state(checked, suffix) == "DAMAGED" and _state(checked, "whole") == "complete"
    assert (f"suffix={suffix}: damaged checkpoint: data object __1_0.distcp is missing (and 1 "
            "more object(s) damaged)") in checked.stdout
    assert "2 complete checkpoint(s) checked against their .metadata: 1 damaged" in checked.stdout


def _state(listing, suffix: str) -> str:
    """The state column of `suffix`'s row in `dcp-fsdp list`'s table."""
    row = next(line for line in listing.stdout.splitlines() if line.startswith(f"| {suffix} "))
    return row.split("|")[2].strip()


def test_an_fs_checkpoint_with_a_truncated_object_is_refused(tmp_path):
    store = tmp_path / "store"
    save = run_cli(["save", "storage=fs", f"storage.path={store}", "nproc=2", "suffix=cut",
                    f"results_dir={tmp_path / 's'}"])
    assert save.returncode == 0, save.stderr
    for copy in ("whole", "gone", "hostile"):
        shutil.copytree(store / "cut", store / copy)
    data = store / "cut" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    line = refused_line(run_cli(["load", "storage=fs", f"storage.path={store}", "nproc=2", "suffix=cut",
                                 f"results_dir={tmp_path / 'l'}"]))
    assert "data object __0_0.distcp holds 1000 of the" in line

    (store / "gone" / "__1_0.distcp").unlink()
    # A .metadata that would run code when unpickled: read through the screen, never run.
    marker = tmp_path / "ran"
    (store / "hostile" / ".metadata").write_bytes(pickle.dumps(_Hostile(str(marker))))
    checked = run_cli(["list", "storage=fs", f"storage.path={store}", "--check"])
    assert checked.returncode == 1, checked.stdout + checked.stderr
    states = {s: _state(checked, s) for s in ("cut", "whole", "gone", "hostile")}
    assert states == {"cut": "DAMAGED", "whole": "complete", "gone": "DAMAGED",
                      "hostile": "DAMAGED"}, checked.stdout
    assert "suffix=cut: damaged checkpoint: data object __0_0.distcp holds 1000 of the" in checked.stdout
    assert "suffix=gone: damaged checkpoint: data object __1_0.distcp is missing;" in checked.stdout
    assert "suffix=hostile: damaged checkpoint: .metadata: refused as" in checked.stdout
    assert not marker.exists()
    plain = run_cli(["list", "storage=fs", f"storage.path={store}"])
    assert plain.returncode == 0 and "DAMAGED" not in plain.stdout, plain.stdout


class _Hostile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
