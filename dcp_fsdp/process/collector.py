"""The cyclic garbage collector paused while a process imports torch: the imports' few hundred
thousand objects, none of them garbage, made it run hundreds of times (2.7 instead of 3.5 CPU s,
docs/measurements/2026-11-27-ci-cost.md)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_for_imports() -> Iterator[None]:
    """No cyclic collection inside the block; the collector as it was after it (an exception
    included). Nested blocks leave it paused until the outermost ends."""
    enabled = gc.isenabled()
    modules_before = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        # What the imports made lives as long as the process: out of every later collection.
        # Only when the block imported something: else a long-lived caller (a sweep, a test
        # process) would freeze its own garbage each time.
        if len(sys.modules) > modules_before:
            gc.freeze()
        if enabled:
            gc.enable()
