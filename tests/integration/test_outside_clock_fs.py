"""The fs timer checked against a clock it does not own: the kernel's modification times of
the checkpoint's files. Every file a save writes (data objects, .metadata) must be written
inside the save's timed region [begin_wall_s, end_wall_s], and the region must not run on
long after the last write (the slack is printed: docs/metrics.md quotes it)."""

from __future__ import annotations

from pathlib import Path

from tests.kit.cli import read_run, run_cli

ITERATIONS = 3
# The kernel stamps mtimes from its coarse clock (one tick, up to ~10 ms, behind time.time()).
KERNEL_TICK_S = 0.02
MAX_SLACK_S = 1.0  # from the last write to the clock's stop: the commit's rename and the barrier


def test_the_save_region_brackets_the_kernels_write_times(tmp_path):
    store = tmp_path / "store"
    result = run_cli(["save", "storage=fs", f"storage.path={store}", "model=tiny_llama", "nproc=2",
                      f"iterations={ITERATIONS}", f"results_dir={tmp_path / 'r'}"])
    assert result.returncode == 0, result.stderr
    run, samples = read_run(tmp_path / "r")
    slacks = []
    for suffix in run["suffixes"]:
        saves = [s for s in samples if s["suffix"] == suffix and s["op"] == "save"]
        begin_s = min(s["begin_wall_s"] for s in saves)
        end_s = max(s["end_wall_s"] for s in saves)
        files = [p for p in Path(store, suffix).iterdir() if p.name.endswith(".distcp") or p.name == ".metadata"]
        written = [p.stat().st_mtime_ns / 1e9 for p in files]
        assert len(files) == 3  # two ranks' data objects and .metadata
        assert begin_s - KERNEL_TICK_S <= min(written), (suffix, begin_s, sorted(written))
        assert max(written) <= end_s + KERNEL_TICK_S, (suffix, end_s, sorted(written))
        slacks.append(end_s - max(written))
    print(f"\nfs save: timer end - last kernel write = {', '.join(f'{s * 1e3:.1f} ms' for s in slacks)}")
    assert max(slacks) < MAX_SLACK_S, slacks
