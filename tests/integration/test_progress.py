"""The progress heartbeat: rank 0 says how far a running save / load has got; off with
progress=false. (Its cost on the timed figures: README, "What the harness costs".)"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from tests.kit.cli import read_run, run_cli, s3_args, s3_env, start_cli
from dcp_fsdp.units import MIB


def test_heartbeat_lines_during_operations_and_none_when_off(s3, s3_uri, tmp_path):
    on = run_cli(["save-and-load", "nproc=2", "model=tiny_gpt2", "progress_interval_s=0.05",
                  *s3_args(s3, s3_uri), f"results_dir={tmp_path / 'on'}"], env=s3_env(s3))
    assert on.returncode == 0, on.stdout + on.stderr
    beats = [line for line in on.stdout.splitlines() if "still running" in line]
    assert any(line.startswith("[dcp-fsdp] save iteration 1: still running, rank 0 uploaded ")
               for line in beats), on.stdout
    for line in beats:
        assert re.search(r"(uploaded|received) [\d.]+ (of [\d.]+ MiB|MiB \(its share of the "
                         r"state: [\d.]+ MiB\)) in [\d.]+ s \([\d.]+ MiB/s; "
                         r"(acknowledged by|from) the storage endpoint.*\)$", line), line
    assert read_run(tmp_path / "on")[0]["status"] == "ok"

    off = run_cli(["save-and-load", "nproc=1", "model=tiny_gpt2", "progress=false",
                   "progress_interval_s=0.05", *s3_args(s3, s3_uri),
                   f"results_dir={tmp_path / 'off'}"], env=s3_env(s3))
    assert off.returncode == 0, off.stdout + off.stderr
    assert "still running" not in off.stdout


PART_BYTES = 8 * MIB  # storage.part_size_mib's default: the connector's buffer, one part
BEAT = re.compile(r"\] (save|load) iteration 1: still running, rank 0 (\w+) ([\d.]+) "
                  r"(of|MiB \(its share)")


def test_the_heartbeat_says_what_moved_through_a_slow_link_not_what_was_buffered(
        s3, s3_uri, tmp_path):
    """Issue 31 item 3: a 3 MiB/s link (the fault proxy paces every body). A save's beats
    never say more than passed the proxy by the line's arrival, plus one part (before: the
    whole 28 MiB "moved" after 0.5 s, 1 MiB through). A load frozen after 6 MiB came
    down (the proxy holds the rest) is seen at 6 MiB (before: 0.0 until its parts were
    whole), and no load beat says more than passed either. The endpoint comes from
    AWS_ENDPOINT_URL (before: the beats read 0.0 MiB unless storage.endpoint was set). Margins: the proxy counts a
    piece before it sends it, and a line is read after it was measured, so a busy machine
    can only make a beat look smaller; the frozen load waits up to 120 s for its beat."""
    from tests.kit.fault_proxy import FaultProxy

    hold_at = 6 * MIB
    beats: list[tuple[str, str, float, int]] = []  # (op, verb, MiB said, proxy bytes then)
    seen_frozen = threading.Event()
    with FaultProxy(s3.endpoint_url, rate_bytes_per_s=3 * MIB, targets=None) as proxy:
        proxy.record_bytes()
        # the endpoint from the environment, as `s3-server start` prints it: the meter once
        # counted only storage.endpoint's port, and read 0.0 MiB for a whole load then
        process = start_cli(["save-and-load", "model=tiny_llama", "progress_interval_s=0.25",
                             f"storage.uri={s3_uri}", f"results_dir={tmp_path}"],
                            env={**s3_env(s3), "AWS_ENDPOINT_URL": proxy.url})
        # the frozen load is let go after its beat, or after 120 s without one (then fails)
        timer = threading.Timer(120, proxy.release_stalls)
        timer.start()
        output: list[str] = []
        try:
            assert process.stdout is not None
            for line in process.stdout:
                output.append(line)
                down_bytes, up_bytes = proxy.bytes_by(time.monotonic())
                if "saved suffix=" in line:  # the load comes next: freeze it 6 MiB in
                    proxy.hold_down_at_bytes = down_bytes + hold_at
                beat = BEAT.search(line)
                if beat is None:
                    continue
                op, verb, said_mib = beat[1], beat[2], float(beat[3])
                beats.append((op, verb, said_mib, up_bytes if op == "save" else down_bytes))
                if (op == "load" and proxy.hold_down_at_bytes is not None
                        and said_mib * MIB >= hold_at - MIB):
                    seen_frozen.set()
                    proxy.release_stalls()
            process.wait(timeout=60)
        finally:
            timer.cancel()
            proxy.release_stalls()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = "".join(output)
    assert process.returncode == 0, text
    saves = [b for b in beats if b[0] == "save"]
    loads = [b for b in beats if b[0] == "load"]
    assert saves and loads, text
    for op, _, said_mib, passed in beats:
        # a line's figure is rounded to 0.1 MiB
        assert said_mib * MIB <= passed + PART_BYTES + 0.05 * MIB, (op, said_mib, passed / MIB)
    assert seen_frozen.is_set(), [b for b in loads]
    assert {b[1] for b in saves} == {"uploaded"} and {b[1] for b in loads} == {"received"}
