"""The cyclic garbage collector paused while a process imports torch.

Python 3.11's collector runs every 700 net allocations, and an older generation's pass visits
every object alive: importing torch, DCP, FSDP and this package (~2,700 modules, a few hundred
thousand objects, none of them garbage) runs it hundreds of times over a growing heap. Paused,
the same imports take 2.7 instead of 3.5 CPU s in a fresh process (2-core VM, 2026-11-28:
docs/measurements/2026-11-27-ci-cost.md), which every node's agent, every exec'd rank and
`dcp-fsdp plan` pay once. The collector runs again as before once the imports are done, so the
timed work of a rank collects garbage as a training process does.
"""

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
        # What the imports made lives as long as the process (modules, their functions
        # and classes): out of every later collection, which would otherwise visit it again
        # (the first passes after the pause are over all of it). A forked rank's agent does
        # the same before it forks (launch/forked_rank.py), for the pages it shares. Only
        # when the block imported something: a long-lived caller (plan_world in a sweep of
        # world sizes, a test process) would otherwise freeze its own garbage each time.
        if len(sys.modules) > modules_before:
            gc.freeze()
        if enabled:
            gc.enable()
