"""What anyone who can write to the bucket (or the directory) can put there must not crash,
hang or rewrite the user's terminal (issue 31, WRONG 4 and 5): a manifest of deeply nested
JSON, a FIFO named `.metadata`, object keys with ESC and newlines. Real commands, on
SeaweedFS and a real directory."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from dcp_fsdp.storage import layout
from tests.kit.cli import run_cli, s3_args, s3_env, s3_client

NESTED_JSON = b"[" * 100_000 + b"]" * 100_000
# ESC[2J clears the screen, ESC]0;...BEL retitles the window, a newline splits a row
HOSTILE = "evil\x1b[2J\x1b]0;owned\x07\nrow"
ESCAPED = r"evil\x1b[2J\x1b]0;owned\x07\nrow"


def _put(s3, uri: str, name: str, body: bytes) -> None:
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    s3_client(s3).put_object(
        Bucket=bucket, Key=f"{prefix}/{name}", Body=body)


def _one_line_refusal(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, \
        result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def _places(kind: str, tmp_path, request) -> tuple[list[str], dict[str, str],
                                                  Callable[[str, bytes], None]]:
    """(the storage settings, the env, a writer of `name` -> bytes under the root)."""
    if kind == "fs":
        root = tmp_path / "ckpt"

        def write(name: str, body: bytes) -> None:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(body)

        return ["storage=fs", f"storage.path={root}"], {}, write
    s3, uri = request.getfixturevalue("s3"), request.getfixturevalue("s3_uri")
    return s3_args(s3, uri), s3_env(s3), lambda name, body: _put(s3, uri, name, body)


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_a_manifest_of_deeply_nested_json_is_one_line(kind, tmp_path, request):
    settings, env, write = _places(kind, tmp_path, request)
    write(f"deep/{layout.METADATA_NAME}", b"not a real .metadata")
    write(f"deep/{layout.MANIFEST_NAME}", NESTED_JSON)
    write(f"deep/{layout.CLAIM_NAME}", NESTED_JSON)  # read by `list` for a claim's owner
    load = run_cli(["load", *settings, "suffix=deep", f"results_dir={tmp_path / 'r'}"],
                   env=env, timeout_s=120)
    _one_line_refusal(load, "suffix=deep: its manifest dcp_fsdp.json is damaged",
                      "integrity=false")
    listing = run_cli(["list", *settings], env=env, timeout_s=120)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr


def test_a_fifo_named_metadata_hangs_nothing(tmp_path):
    """`load` and `list --check` opened it and waited for a writer forever."""
    root = tmp_path / "ckpt"
    (root / "fifo").mkdir(parents=True)
    os.mkfifo(root / "fifo" / layout.METADATA_NAME)
    settings = ["storage=fs", f"storage.path={root}"]
    load = run_cli(["load", *settings, "suffix=fifo", f"results_dir={tmp_path / 'r'}"],
                   timeout_s=60)
    _one_line_refusal(load, f"{root / 'fifo' / layout.METADATA_NAME}: not a regular file")
    check = run_cli(["list", *settings, "--check"], timeout_s=60)
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stderr
    assert "| DAMAGED " in check.stdout and "not a regular file" in check.stdout, check.stdout


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_keys_with_control_characters_are_printed_escaped(kind, tmp_path, request):
    """`list` printed object keys raw (ESC[2J cleared the screen, a newline split a row), and
    an error line naming the checkpoints there did too."""
    settings, env, write = _places(kind, tmp_path, request)
    write(f"{HOSTILE}/__0_0.distcp", b"data")
    write(f"{HOSTILE}-done/{layout.METADATA_NAME}", b"meta")
    listing = run_cli(["list", *settings], env=env, timeout_s=120)
    assert listing.returncode == 0, listing.stderr
    shown = listing.stdout + listing.stderr
    assert not any(ch in shown for ch in "\x1b\x07"), repr(shown)
    rows = [line for line in listing.stdout.splitlines() if line.startswith("| evil")]
    assert [row.split("|")[1].strip() for row in rows] == [ESCAPED, f"{ESCAPED}-done"], rows
    assert not any(line.startswith("row") for line in shown.splitlines()), shown
    load = run_cli(["load", *settings, "suffix=absent", f"results_dir={tmp_path / 'r'}"],
                   env=env, timeout_s=120)
    _one_line_refusal(load, f"complete checkpoints there: {ESCAPED}-done")
    assert not any(ch in load.stderr for ch in "\x1b\x07"), repr(load.stderr)
