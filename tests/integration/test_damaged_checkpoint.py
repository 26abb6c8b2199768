"""A checkpoint with a data object deleted or cut short is refused in one line naming the
object, before any rank builds the model (DCP would fail part way with "The key does not
exist" or "S3 stream exhausted"). Real objects on SeaweedFS and on a file system."""

from __future__ import annotations

from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def refused_line(result) -> str:
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("dcp-fsdp: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_an_s3_checkpoint_missing_and_short_of_data_objects_is_refused_naming_them(s3, s3_uri, tmp_path):
    import boto3

    save = run_cli(["save", *s3_args(s3, s3_uri), "nproc=2", f"results_dir={tmp_path / 's'}"], env=s3_env(s3))
    assert save.returncode == 0, save.stderr
    suffix = read_run(tmp_path / "s")[0]["suffixes"][0]
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.access_key_id,
                          aws_secret_access_key=s3.secret_access_key, region_name=s3.region)
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
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


def test_an_fs_checkpoint_with_a_truncated_object_is_refused(tmp_path):
    store = tmp_path / "store"
    save = run_cli(["save", "storage=fs", f"storage.path={store}", "nproc=2", "suffix=cut",
                    f"results_dir={tmp_path / 's'}"])
    assert save.returncode == 0, save.stderr
    data = store / "cut" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    line = refused_line(run_cli(["load", "storage=fs", f"storage.path={store}", "nproc=2", "suffix=cut",
                                 f"results_dir={tmp_path / 'l'}"]))
    assert "data object __0_0.distcp holds 1000 of the" in line
