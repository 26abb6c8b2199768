"""`dcp-fsdp wait --duration 2m`: hold a Slurm allocation doing nothing (batch/waitbatch.sh):
one wake-up per heartbeat, exit 0 at the end or on SIGTERM/SIGINT. A duration always carries
its unit, so minutes and hours cannot be confused. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import sys
import time
from types import FrameType
from typing import NoReturn, TextIO

from dcp_fsdp.errors import UserError

MIN_HEARTBEAT_S = 1.0
MAX_DURATION_S = 366 * 86400.0  # beyond a year: a typo, or `forever`
_UNIT_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(sec|min|hr|s|m|h|d)")


def parse_duration(text: str, option: str) -> float:
    """Seconds from '90s', '2m', '1h30m', '1.5h', '2d', 'forever' (math.inf). A unit is required."""
    value = text.strip().lower()
    if value in ("forever", "inf", "infinity"):
        return math.inf
    compact = value.replace(" ", "")
    if compact == "0":
        return 0.0
    parts = _PART.findall(compact)
    if not parts or "".join(number + unit for number, unit in parts) != compact:
        if re.fullmatch(r"\d+(?:\.\d*)?", compact):
            raise UserError(f"{option}={text}: give a unit, e.g. {option}={compact}m "
                            f"(minutes), {compact}h (hours) or {compact}s (seconds)")
        raise UserError(f"{option}={text}: not a duration; write e.g. 90s, 2m, 1h30m, 1.5h "
                        "or forever")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def format_seconds(seconds: float) -> str:
    if math.isinf(seconds):
        return "forever"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class _Signalled(Exception):
    """args[0]: the signal's number."""


def _raise_signalled(signum: int, frame: FrameType | None) -> NoReturn:
    raise _Signalled(signum)


def wait(duration_s: float, heartbeat_s: float, out: TextIO | None = None) -> int:
    """Sleep for duration_s (math.inf: until signalled); 0 on completion or on SIGTERM/SIGINT."""
    out = out or sys.stdout
    where = f"host={socket.gethostname()} pid={os.getpid()}"
    task = os.environ.get("SLURM_PROCID")
    if os.environ.get("SLURM_JOB_ID"):
        where += f" job={os.environ['SLURM_JOB_ID']}" + (f" task={task}" if task else "")

    def say(message: str) -> None:
        print(f"[dcp-fsdp] wait: {where}: {message}", file=out, flush=True)

    previous = {sig: signal.signal(sig, _raise_signalled) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    deadline = started + duration_s
    try:
        say(("holding until signalled" if math.isinf(duration_s)
             else f"holding for {format_seconds(duration_s)}")
            + (f", heartbeat every {format_seconds(heartbeat_s)}" if heartbeat_s > 0 else ""))
        next_beat = started + heartbeat_s if heartbeat_s > 0 else math.inf
        while True:
            now = time.monotonic()
            if now >= deadline:
                say(f"done after {format_seconds(now - started)}")
                return 0
            if now >= next_beat:
                left = "until signalled" if math.isinf(deadline) else \
                    f"{format_seconds(deadline - now)} left"
                say(f"alive, {format_seconds(now - started)} elapsed, {left}")
                while next_beat <= now:
                    next_beat += heartbeat_s
            # One wake-up per heartbeat (or at the deadline); a signal interrupts the sleep.
            wake = min(deadline, next_beat)
            time.sleep(3600.0 if math.isinf(wake) else max(0.0, wake - time.monotonic()))
    except _Signalled as signalled:
        name = signal.Signals(signalled.args[0]).name
        say(f"{name} after {format_seconds(time.monotonic() - started)}: exiting cleanly")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args: argparse.Namespace) -> int:
    duration_s = parse_duration(args.duration, "--duration")
    heartbeat_s = parse_duration(args.heartbeat, "--heartbeat")
    if 0 < heartbeat_s < MIN_HEARTBEAT_S:
        raise UserError(f"--heartbeat={args.heartbeat}: too often (a line per heartbeat); "
                        f"give {MIN_HEARTBEAT_S:g}s or more, or 0 for none")
    if math.isfinite(duration_s) and duration_s > MAX_DURATION_S:
        raise UserError(f"--duration={args.duration}: more than a year; use --duration "
                        "forever to wait until signalled")
    return wait(duration_s, heartbeat_s)
