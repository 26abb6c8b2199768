"""The tool reads a checkpoint's `.metadata` once per run, through the screen: the
launcher's pre-load screen hands what it read to rank 0 (the compatibility check and the
ceiling use it); DCP's own read, once per rank in its load, is DCP's and stays. Counted at
a proxy in front of a real SeaweedFS: every GET of `.metadata` by anyone."""

from __future__ import annotations

from tests.kit.cli import read_run, run_cli, s3_args, s3_env
from tests.kit.fault_proxy import FaultProxy

NPROC = 2
METADATA_GETS = ("GetObject", "GetObjectRanged")


def test_a_load_with_a_ceiling_reads_metadata_once_plus_dcps_own(s3, s3_uri, tmp_path):
    save = run_cli(["save", *s3_args(s3, s3_uri), "model=tiny_llama", f"nproc={NPROC}",
                    f"results_dir={tmp_path / 's'}"], env=s3_env(s3))
    assert save.returncode == 0, save.stderr
    suffix = read_run(tmp_path / "s")[0]["suffixes"][0]
    with FaultProxy(s3.endpoint_url, latency_s=0.001, targets=METADATA_GETS,
                    key_pattern=rf"/{suffix}/\.metadata$") as proxy:
        load = run_cli(["load", f"storage.uri={s3_uri}", f"storage.endpoint={proxy.url}",
                        "model=tiny_llama", f"nproc={NPROC}", f"suffix={suffix}", "ceiling=true",
                        f"results_dir={tmp_path / 'l'}"], env=s3_env(s3))
        gets = sum(proxy.counts.get("latency", {}).values())
    assert load.returncode == 0, load.stderr
    run, samples = read_run(tmp_path / "l")
    assert run["status"] == "ok" and {s["op"] for s in samples} >= {"load", "raw_get"}
    # the launcher's screen (1), DCP's load on each rank (NPROC) and the ceiling's load
    # through the tool's reader on each rank (NPROC: DCP's own read, in dcp.load); rank 0's
    # compatibility check and the ceiling's object sizes read none of their own
    assert gets == 1 + 2 * NPROC, proxy.counts
