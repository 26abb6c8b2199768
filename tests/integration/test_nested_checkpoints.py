"""A folder one level below the given prefix that holds checkpoints of its own
(`ckpt/<run>/<suffix>`) is a prefix, not an incomplete checkpoint: `list` says what it holds
and `delete` refuses it, --force or not (issue 31, WRONG 1: `delete suffix=b00 --force`
removed three complete checkpoints). Real saves, on the file system and on SeaweedFS."""

from __future__ import annotations

import pytest

from tests.kit.cli import run_cli, s3_args, s3_env, s3_client


def _places(kind: str, tmp_path, s3, s3_uri) -> tuple[list[str], list[str], dict[str, str]]:
    """(the settings naming the parent `net`, those naming its folder `b00`, the env)."""
    if kind == "fs":
        net = tmp_path / "net"
        return (["storage=fs", f"storage.path={net}"],
                ["storage=fs", f"storage.path={net / 'b00'}"], {})
    return s3_args(s3, s3_uri), s3_args(s3, f"{s3_uri}/b00"), s3_env(s3)


def _put_deep_object(kind: str, tmp_path, s3, s3_uri) -> None:
    """`odd/data/__0_0.distcp`: objects only in a folder below `odd`, no checkpoint marker."""
    if kind == "fs":
        folder = tmp_path / "net" / "odd" / "data"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"data")
        return
    bucket, prefix = s3_uri[len("s3://"):].split("/", 1)
    s3_client(s3).put_object(
        Bucket=bucket, Key=f"{prefix}/odd/data/__0_0.distcp", Body=b"data")


def _rows(listing: str) -> dict[str, str]:
    """{suffix: its table row} of a `list` output."""
    return {line.split("|")[1].strip(): line for line in listing.splitlines()
            if line.startswith("| ") and not line.startswith("| suffix")}


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_a_prefix_holding_checkpoints_is_listed_as_one_and_never_deleted(kind, tmp_path, request):
    s3 = request.getfixturevalue("s3") if kind == "s3" else None
    s3_uri = request.getfixturevalue("s3_uri") if kind == "s3" else ""
    parent, folder, env = _places(kind, tmp_path, s3, s3_uri)
    save = run_cli(["save", *folder, "iterations=3", "suffix=run", "nproc=1",
                    f"results_dir={tmp_path / 'results'}"], env=env)
    assert save.returncode == 0, save.stderr
    _put_deep_object(kind, tmp_path, s3, s3_uri)

    listing = run_cli(["list", *parent], env=env)
    assert listing.returncode == 0, listing.stderr
    rows = _rows(listing.stdout)
    assert "PREFIX OF 3 CHECKPOINT(S)" in rows["b00"] and "INCOMPLETE" not in rows["b00"], rows
    note = next(line for line in listing.stdout.splitlines() if line.startswith("suffix=b00:"))
    assert "run-1, run-2, run-3" in note and f"`dcp-fsdp list {folder[1 if kind == 'fs' else 0]}`" in note, note

    for suffix, says in (("b00", "a prefix holding 3 checkpoint(s)"),
                         ("odd", "holds objects only in folders below it")):
        refused = run_cli(["delete", *parent, f"suffix={suffix}", "--force"], env=env)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.strip().count("\n") == 0, refused.stderr  # one line
        assert says in refused.stderr and "left alone" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr

    load = run_cli(["load", *parent, "suffix=b00", f"results_dir={tmp_path / 'loads'}"], env=env)
    assert load.returncode == 2 and load.stderr.strip().count("\n") == 0, load.stderr
    assert "suffix=b00: not a checkpoint but a prefix holding 3 checkpoint(s)" in load.stderr
    assert "did not finish" not in load.stderr

    below = run_cli(["list", *folder], env=env)
    assert below.returncode == 0, below.stderr
    kept = _rows(below.stdout)  # all three still there, whole
    assert sorted(kept) == ["run-1", "run-2", "run-3"], below.stdout
    assert all("| complete " in row for row in kept.values()), below.stdout
    assert "odd" in _rows(run_cli(["list", *parent], env=env).stdout)
