"""The heartbeat: beats while an operation runs, says bytes, rate and time, then stops."""

from __future__ import annotations

import time

from dcp_fsdp.process.progress import MIB, Heartbeat


def test_heartbeat_beats_while_running_and_stops_after():
    lines: list[str] = []
    moved = [0]
    with Heartbeat("save iteration 2", lambda: moved[0], 100 * MIB, 0.05, lines.append) as beat:
        for _ in range(5):
            moved[0] += 10 * MIB
            time.sleep(0.05)
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count == beat.beats and count >= 2
    assert lines[-1].startswith("save iteration 2: still running, rank 0 moved ")
    assert " of 100.0 MiB in " in lines[-1] and "MiB/s)" in lines[-1]


def test_line_without_an_expected_total():
    beat = Heartbeat("load iteration 1", lambda: 3 * MIB, None, 10, lambda _: None)
    assert beat.line(2.0) == ("load iteration 1: still running, rank 0 moved 3.0 MiB in 2.0 s "
                              "(1.5 MiB/s)")
