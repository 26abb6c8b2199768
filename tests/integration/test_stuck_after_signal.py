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
    assert process.stdout is not None
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
    assert process.stdout is not None
    return code, time.monotonic() - sent, process.stdout.read()


def test_a_main_thread_stuck_after_sigterm_is_ended_by_the_watcher():
    code, took_s, out = run_and_stop("watch", wait_s=10)
    assert code == 130 and "stuck after SIGTERM" in out
    assert 0.9 <= took_s < 5, took_s


def test_without_the_watcher_it_would_not_end():
    code, took_s, _ = run_and_stop("none", wait_s=3)
    assert code is None  # still running 3 s later: what torch's agent would wait out


UNRAISABLE = """
import os, signal, sys, time
from dcp_fsdp.process.signals import InterruptGuard

guard = InterruptGuard()
if sys.argv[1] == "guard":
    guard.install()
else:
    signal.signal(signal.SIGINT, guard._on_signal)  # the handler alone, as before the hook

class Dropped:
    def __del__(self):  # the signal lands here: an exception Python cannot propagate
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            time.sleep(0)

Dropped()
try:
    time.sleep(0.2)
except BaseException:
    pass
print("noted", guard.signal_name, flush=True)
"""


def test_a_signal_raised_where_python_cannot_propagate_it_prints_no_traceback():
    """A Ctrl-C mid-tune landed while the connector built an S3Exception: Python printed
    "Exception ignored in: 'S3Exception'" and a traceback. The guard notes the signal
    (the run ends interrupted) and its hook keeps the traceback out of the output."""
    outputs = {}
    for how in ("guard", "handler-only"):
        done = subprocess.run([sys.executable, "-c", UNRAISABLE, how], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "noted SIGINT" in done.stdout, done
        outputs[how] = done.stderr
    assert "Traceback" in outputs["handler-only"] and "Exception ignored" in outputs["handler-only"]
    assert outputs["guard"] == "", outputs["guard"]
