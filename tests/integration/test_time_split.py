"""Where a checkpoint's time goes, for each client (issue 45): behind a link slowed to a few
MiB/s the time inside the storage client is most of a save and of a load, and on tmpfs it is
a small part; in every case the parts add up to the timed duration. The seconds asserted
come from the link's rate (bytes / rate), not from how busy the machine is."""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env
from tests.kit.fault_proxy import FaultProxy

MIB = 2**20
RATE_BYTES_PER_S = 4 * MIB  # tiny_llama bf16: 14 MiB, so at least 3.5 s each way
SAVE_PARTS = ("plan_s", "stage_s", "upload_s", "commit_s")
LOAD_PARTS = ("plan_s", "storage_s", "deserialise_s", "target_copy_s", "commit_s")


def parts_s(sample: dict) -> float:
    return sum(sample[name] for name in (SAVE_PARTS if sample["op"] == "save" else LOAD_PARTS))


@pytest.mark.parametrize("client", ("s3torchconnector", "fsspec", "msc"))
def test_a_slow_link_is_storage_time_for_each_client(s3, s3_uri, tmp_path, client):
    with FaultProxy(s3.endpoint_url, rate_bytes_per_s=RATE_BYTES_PER_S) as proxy:
        result = run_cli(["save-and-load", *s3_args(s3, s3_uri), f"storage.endpoint={proxy.url}",
                          "model.dtype=bf16", f"storage.client={client}", "progress=false",
                          f"results_dir={tmp_path}"], env=s3_env(s3), timeout_s=240)
    assert result.returncode == 0, result.stderr
    run, samples = read_run(tmp_path)
    state_bytes = run["model"]["state_bytes"]
    at_link_rate_s = state_bytes / RATE_BYTES_PER_S
    for sample in samples:
        assert parts_s(sample) == pytest.approx(sample["duration_s"], rel=0.05), sample
        inside_client_s = sample["upload_s" if sample["op"] == "save" else "storage_s"]
        # the link alone takes at_link_rate_s: that time is the client's, not DCP's
        assert inside_client_s >= 0.8 * at_link_rate_s, sample
        assert inside_client_s >= 0.6 * sample["duration_s"], sample
    assert "Bound by the storage client" in result.stdout
    loads = [sample for sample in samples if sample["op"] == "load"]
    # MSC downloads each of these small objects whole (under its 512 MiB switch), and says so
    assert all(s["msc_reads"] == ("whole" if client == "msc" else None) for s in loads), loads
    assert ("MSC downloaded each object whole" in result.stdout) == (client == "msc")


def test_a_load_from_memory_spends_little_in_storage(tmp_path, tmpfs_dir):
    """The same model on tmpfs (no network, no disk): the split still adds up, and the load's
    time in storage (the kernel's copy) is a fraction of what the slow link took."""
    result = run_cli(["save-and-load", "storage=fs", f"storage.path={tmpfs_dir}",
                      "model.dtype=bf16", "progress=false", f"results_dir={tmp_path / 'r'}"],
                     env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    run, samples = read_run(tmp_path / "r")
    (load,) = [s for s in samples if s["op"] == "load"]
    assert parts_s(load) == pytest.approx(load["duration_s"], rel=0.05)
    at_link_rate_s = run["model"]["state_bytes"] / RATE_BYTES_PER_S
    assert load["storage_s"] < 0.1 * at_link_rate_s, load
    assert load["target_copy_s"] >= 0 and load["deserialise_s"] > 0
