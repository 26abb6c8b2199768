"""A rank whose main thread stays in native code after SIGTERM (an S3 request that stalled,
a pool joining uploads that never end) still ends within the guard's time, not after torch's
agent's shutdown timeout. A real process: the join below never returns, as a stuck native
call would not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.kit.cli import REPO, clean_env

STUCK = """
import os, sys, threading, time
from dcp_fsdp.process.signals import InterruptGuard

def on_stuck(name):
    print("stuck after", name, flush=True)
    os._exit(130)

guard = InterruptGuard(stuck_after_s=float(sys.argv[1]))
guard.install(on_stuck=on_stuck if sys.argv[2] == "watch" else None)
never = threading.Thread(target=threading.Event().wait, daemon=True)
never.start()
print("ready", flush=True)
try:
    time.sleep(600)
except BaseException:
    never.join()  # the unwinding waits for a thread that never ends
"""


def run_and_stop(watch: str, wait_s: float) -> tuple[int | None, float, str]:
    process = subprocess.Popen([sys.executable, "-c", STUCK, "1.0", watch], cwd=REPO,
                               env=clean_env(), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # inside its sleep by then, so the signal lands in the try
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None, time.monotonic() - sent, ""
    return code, time.monotonic() - sent, process.stdout.read()


def test_a_main_thread_stuck_after_sigterm_is_ended_by_the_watcher():
    code, took_s, out = run_and_stop("watch", wait_s=10)
    assert code == 130 and "stuck after SIGTERM" in out
    assert 0.9 <= took_s < 5, took_s


def test_without_the_watcher_it_would_not_end():
    code, took_s, _ = run_and_stop("none", wait_s=3)
    assert code is None  # still running 3 s later: what torch's agent would wait out
