"""The timer checked against a clock it does not own: the test's fault proxy holds each
request of one rank's data object for a known time, and the save's `duration_s` must grow
by that much; the same delay on a request outside the timed region (the manifest the loop
writes after the save) must move nothing.

One rank, one data object of one part (part size above the object), so the delay adds once
per save: not hidden by parallel parts, not multiplied by sequential ones. The figure
compared is the minimum over the iterations, the least disturbed by the rest of the machine.
"""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_env
from tests.kit.fault_proxy import FaultProxy

DELAY_S = 0.5
TOLERANCE_S = 0.15
ITERATIONS = 4
DATA_WRITES = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")


def min_save_s(s3, uri, out, **proxy) -> tuple[float, dict]:
    with FaultProxy(s3.endpoint_url, **proxy) as fault_proxy:
        result = run_cli(["save", f"storage.uri={uri}", f"storage.endpoint={fault_proxy.url}",
                          "model=tiny_llama", "nproc=1", f"iterations={ITERATIONS}",
                          "storage.part_size_mib=256", f"results_dir={out}"], env=s3_env(s3))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    run, samples = read_run(out)
    saves = [s["duration_s"] for s in samples if s["op"] == "save"]
    assert run["status"] == "ok" and len(saves) == ITERATIONS
    return min(saves), fault_proxy.counts.get("latency", {})


@pytest.mark.parametrize("where", ["timed", "untimed"])
def test_a_known_delay_in_storage_moves_the_timer_by_exactly_that(s3, s3_uri, tmp_path, where):
    base_s, _ = min_save_s(s3, f"{s3_uri}-base", tmp_path / "base", latency_s=0.0)
    if where == "timed":  # the data object's upload: inside dcp.save
        delayed_s, held = min_save_s(s3, f"{s3_uri}-held", tmp_path / "held",
                                     latency_s=DELAY_S, targets=("UploadPart", "PutObject"),
                                     key_pattern=r"__0_\d+\.distcp$")
        expected_growth_s = DELAY_S
    else:  # the manifest rank 0 writes after the save's clock stopped
        delayed_s, held = min_save_s(s3, f"{s3_uri}-held", tmp_path / "held",
                                     latency_s=DELAY_S, targets=("PutObject",),
                                     key_pattern=r"/dcp_fsdp\.json$")
        expected_growth_s = 0.0
    # the proxy held what it was meant to, once per save
    assert sum(held.values()) == ITERATIONS, held
    growth_s = delayed_s - base_s
    assert abs(growth_s - expected_growth_s) <= TOLERANCE_S, (
        f"{where}: min duration_s {base_s:.3f} -> {delayed_s:.3f} s (grew {growth_s:.3f} s, "
        f"expected {expected_growth_s} ± {TOLERANCE_S})")
