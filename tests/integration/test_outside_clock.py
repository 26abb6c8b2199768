"""The timer checked against a clock it does not own: the test's fault proxy holds each
request of one rank's data object for a known time, and the save's `duration_s` must grow
by that much; the same delay on a request outside the timed region (the manifest the loop
writes after the save) must move nothing.

One rank, one data object of one part (part size above the object), so the delay adds once
per save: not hidden by parallel parts, not multiplied by sequential ones. The figure
compared is the minimum over the held iterations against the minimum over the others of the
same run (held and untouched ones alternate), the least disturbed by the rest of the machine.
"""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_env
from tests.kit.fault_proxy import FaultProxy

DELAY_S = 0.5
TOLERANCE_S = 0.15
ITERATIONS = 6  # odd iterations run untouched, even ones are held: paired within one run
SUFFIX = "clk"
HELD = r"[246]"


def saves_by_iteration(s3, uri, out, **proxy) -> tuple[dict[int, float], dict]:
    with FaultProxy(s3.endpoint_url, **proxy) as fault_proxy:
        result = run_cli(["save", f"storage.uri={uri}", f"storage.endpoint={fault_proxy.url}",
                          "model=tiny_llama", "nproc=1", f"iterations={ITERATIONS}", f"suffix={SUFFIX}",
                          "storage.part_size_mib=256", f"results_dir={out}"], env=s3_env(s3))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    run, samples = read_run(out)
    saves = {s["iteration"]: s["duration_s"] for s in samples if s["op"] == "save"}
    assert run["status"] == "ok" and len(saves) == ITERATIONS
    return saves, fault_proxy.counts.get("latency", {})


@pytest.mark.parametrize("where", ["timed", "untimed"])
def test_a_known_delay_in_storage_moves_the_timer_by_exactly_that(s3, s3_uri, tmp_path, where):
    if where == "timed":  # the data object's upload: inside dcp.save
        saves, held = saves_by_iteration(s3, s3_uri, tmp_path, latency_s=DELAY_S,
                                         targets=("UploadPart", "PutObject"),
                                         key_pattern=rf"/{SUFFIX}-{HELD}/__0_\d+\.distcp$")
        expected_growth_s = DELAY_S
    else:  # the manifest rank 0 writes after the save's clock stopped
        saves, held = saves_by_iteration(s3, s3_uri, tmp_path, latency_s=DELAY_S, targets=("PutObject",),
                                         key_pattern=rf"/{SUFFIX}-{HELD}/dcp_fsdp\.json$")
        expected_growth_s = 0.0
    # the proxy held what it was meant to, once per even iteration
    assert sum(held.values()) == ITERATIONS // 2, held
    # the minimum of each half: the iteration least disturbed by the rest of the machine
    base_s = min(s for i, s in saves.items() if i % 2)
    delayed_s = min(s for i, s in saves.items() if not i % 2)
    growth_s = delayed_s - base_s
    assert abs(growth_s - expected_growth_s) <= TOLERANCE_S, (
        f"{where}: min duration_s {base_s:.3f} -> {delayed_s:.3f} s (grew {growth_s:.3f} s, "
        f"expected {expected_growth_s} ± {TOLERANCE_S}; every save {saves})")
