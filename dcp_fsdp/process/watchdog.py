"""The op watchdog: the one way out of a stalled native call (shared by the checkpoint
loop, `loop.py`, and the raw ceiling, `ceiling.py`)."""

from __future__ import annotations

import threading
from typing import Callable


class Watchdog:
    """Calls `on_timeout(message)` from a timer thread if the block runs too long: a stalled S3
    request blocks inside native code, where no Python exception can reach it, so the callback
    ends the process instead (after recording the failure)."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None], message: str) -> None:
        self.timer = threading.Timer(timeout_s, on_timeout, args=(message,))
        self.timer.daemon = True

    def __enter__(self) -> "Watchdog":
        self.timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.timer.cancel()
