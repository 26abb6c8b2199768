"""The tool's reader (storage.read_ahead=N, storage/read_ahead.py) on real ranks and a real
S3 server, for each client: loads at another world size (FSDP 2 -> 1 with AdamW state) and
from tensor parallel (tp=2 on 2 ranks -> tp=1 on 1) verified bit for bit, labelled as the
tool's reader in the record and the end-of-run lines, and held within its memory bound."""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env

CLIENTS = ("s3torchconnector", "fsspec", "msc")
MIB = 2**20


def run(store: list[str], env: dict[str, str] | None, results_dir, *args: str):
    result = run_cli([*args, *store, "progress=false", f"results_dir={results_dir}"], env=env,
                     timeout_s=240)
    assert result.returncode == 0, result.stderr
    return result, read_run(results_dir)


@pytest.mark.parametrize("client", (*CLIENTS, "files"))
def test_resharded_and_tensor_parallel_loads_through_the_tool_s_reader(request, tmp_path, client):
    """For files each item lands straight in its target where it can (storage/read_ahead.py
    `_land`): the resharded and TP loads are the ones where it cannot, and must not."""
    if client == "files":
        on, env = f"storage.path={request.getfixturevalue('tmpfs_dir')}", None
        store = lambda name: ["storage=fs"]  # noqa: E731
    else:
        s3, s3_uri = request.getfixturevalue("s3"), request.getfixturevalue("s3_uri")
        on, env = f"storage.client={client}", s3_env(s3)
        store = lambda name: s3_args(s3, f"{s3_uri}/{name}")  # noqa: E731
    loads = []
    for name, save_settings, load_settings in (
            ("fsdp", ["state=model_and_optimizer"], ["state=model_and_optimizer"]),
            ("tp", ["model.tp=2"], ["model.tp=1"])):
        _, (saved, _) = run(store(name), env, tmp_path / f"save-{name}", "save", "nproc=2", on,
                            *save_settings)
        (suffix,) = saved["suffixes"]
        result, (loaded, samples) = run(
            store(name), env, tmp_path / f"load-{name}", "load", "nproc=1", on,
            f"suffix={suffix}", "storage.read_ahead=3", "storage.read_ahead_mib=2", *load_settings)
        assert loaded["integrity"] == {suffix: {"checked": True, "reason": None}}
        (load,) = [s for s in samples if s["op"] == "load"]
        assert load["reader"] == "read_ahead=3"
        assert "(the tool's reader, read_ahead=3, not DCP's" in result.stdout
        loads.append(load)
    for load in loads:
        # at most 3 groups of 2 MiB held, or 3 of the largest item (tiny_llama: the 2 MiB
        # embedding and head shards of fp32 rows, 4 MiB whole)
        assert 0 < load["read_ahead_peak_bytes"] <= 3 * 4 * MIB + 3 * 4096, load
        assert load["storage_s"] > 0 and load["fetched_bytes"] >= load["bytes"]


def test_the_tool_s_reader_holds_no_more_memory_than_its_bound(tmp_path, tmpfs_dir):
    """Peak RSS of a load through the tool's reader within its bound of DCP's own load of the
    same checkpoint (each in a fresh process; files on tmpfs, so that only the reader's own
    buffers differ: through the connector each GET in flight also holds the native client's
    part buffers, docs/headroom.md)."""
    store = ["storage=fs", f"storage.path={tmpfs_dir}", "model.dtype=bf16", "progress=false"]
    saved = run_cli(["save", *store, f"results_dir={tmp_path / 'save'}"])
    assert saved.returncode == 0, saved.stderr
    (suffix,) = read_run(tmp_path / "save")[0]["suffixes"]
    peaks = {}
    for read_ahead in (0, 4):
        result = run_cli(["load", *store, f"suffix={suffix}", f"storage.read_ahead={read_ahead}",
                          "storage.read_ahead_mib=1", f"results_dir={tmp_path / str(read_ahead)}"])
        assert result.returncode == 0, result.stderr
        (load,) = [s for s in read_run(tmp_path / str(read_ahead))[1] if s["op"] == "load"]
        peaks[read_ahead] = load["peak_rss_bytes"]
    bound = 4 * 2 * MIB  # 4 groups of 1 MiB, or of the largest item (the 1.4 MiB bf16 head)
    assert peaks[4] <= peaks[0] + bound + 16 * MIB, peaks  # 16 MiB: its 4 threads' stacks
