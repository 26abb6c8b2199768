"""The op watchdog: the one way out of a stalled native call (shared by the checkpoint
loop, `loop.py`, and the raw ceiling, `ceiling.py`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def op_watchdog(timeout_s: float, on_timeout: Callable[[str], None], message: str) -> Iterator[None]:
    """Calls `on_timeout(message)` from a timer thread if the block runs too long: a stalled S3
    request blocks in native code, out of any Python exception's reach: the callback records and exits."""
    timer = threading.Timer(timeout_s, on_timeout, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
