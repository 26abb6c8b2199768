"""Interrupts end a run as `interrupted`, stop every rank within seconds, and keep the
operations already measured (every rank's samples of each finished operation)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.kit.cli import REPO, read_run, read_until, run_cli, s3_args, s3_env, start_cli

INTERRUPT_DEADLINE_S = 20  # ranks record and exit well within this on 2 busy cores


@pytest.mark.parametrize("how", ["group-sigint", "launcher-sigint", "launcher-sigterm"])
def test_an_interrupt_mid_run_is_recorded_as_interrupted(s3, s3_uri, tmp_path, how):
    """Ctrl-C in a terminal signals the whole group; `kill -INT/-TERM <launcher>` only the
    launcher. Either way: exit 130 in seconds, status interrupted, no further saves."""
    process = start_cli(["save-and-load", "nproc=2", "iterations=200", *s3_args(s3, s3_uri),
                         f"results_dir={tmp_path}", "integrity=false"], s3_env(s3))
    read_until(process, "saved suffix=", timeout_s=120)  # iteration 1's save finished: mid-run now
    signalled_at = time.monotonic()
    if how == "group-sigint":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT if how == "launcher-sigint" else signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=INTERRUPT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"{how}: still running {INTERRUPT_DEADLINE_S} s after the signal") from None
    stopped_s = time.monotonic() - signalled_at
    assert process.returncode == 130, output
    run, samples = read_run(tmp_path)
    expected = "SIGTERM" if how == "launcher-sigterm" else "SIGINT"
    assert run["status"] == "interrupted", run
    assert run["error"] == f"interrupted by {expected}"
    # The operations finished before the signal are kept whole: both ranks of each.
    ops = {(s["op"], s["iteration"]) for s in samples}
    assert ("save", 1) in ops
    for op in ops:
        assert sorted(s["rank"] for s in samples if (s["op"], s["iteration"]) == op) == [0, 1]
    # ... and no operation began after it (the bug: 16 more iterations). Counted by the ranks'
    # own begin clocks (CLOCK_MONOTONIC, one for the host), not by how many ran before the
    # test read "saved suffix=" (under load, 15 iterations ran before it signalled). The one
    # operation in flight when the signal came may have begun a moment before it.
    begun_after = {(s["op"], s["iteration"]) for s in samples if s["begin_mono_s"] > signalled_at}
    assert len(begun_after) <= 1, (stopped_s, sorted(begun_after))
    # No rank is left behind.
    leftover = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


def _interrupted_at(args: list[str], share: float,
                    whole_s: float) -> tuple[subprocess.Popen, str, float]:
    """The command, sent SIGINT `share` of `whole_s` after its start unless it ended first
    (then the seconds returned are how long it took); with what it printed."""
    started = time.monotonic()
    process = start_cli(args)
    try:
        process.wait(timeout=share * whole_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
    elapsed_s = time.monotonic() - started
    output, _ = process.communicate(timeout=60)
    return process, output, elapsed_s


def test_ctrl_c_at_any_moment_of_a_command_is_one_line_and_130(tmp_path):
    """The trial's case 109: Ctrl-C 0.6 s into `dcp-fsdp report` printed a KeyboardInterrupt
    traceback from the pandas import. SIGINT at instants spread over the command's whole
    life (its imports included): exit 130 and one line, never a traceback."""
    for record in (REPO / "tests" / "unit" / "data").glob("*.jsonl"):
        shutil.copy(record, tmp_path)
    args = ["report", str(tmp_path), "--format", "md"]
    whole_s = math.inf
    for _ in range(2):  # the shorter of a cold and a warm run: the instants below fall inside
        started = time.monotonic()  # later runs, which a busy machine only makes longer
        assert run_cli(args).returncode == 0
        whole_s = min(whole_s, time.monotonic() - started)  # the imports are most of it
    interrupted = 0
    for share in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9):
        process, output, elapsed_s = _interrupted_at(args, share, whole_s)
        if process.returncode == 0:  # it ended before its instant (the machine got quieter
            whole_s = elapsed_s  # since whole_s was taken): once more, with its time
            process, output, _ = _interrupted_at(args, share, whole_s)
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, (share, output)
        if process.returncode in (0, -signal.SIGINT):
            # it finished first, or the signal came while the interpreter started or ended
            # (no handler of Python's yet, or no more): killed by it, silent, 130 to a shell
            continue
        assert process.returncode == 130, (share, process.returncode, output)
        assert output.splitlines()[-1] == "dcp-fsdp: error: interrupted", (share, output)
        # one line says it (a report's own table may say "0 failed or interrupted")
        assert output.count("dcp-fsdp: error: interrupted") == 1, output
        interrupted += 1
    assert interrupted >= 3, "most instants fall inside the command"
