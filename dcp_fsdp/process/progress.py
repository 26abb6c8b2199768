"""A heartbeat during long saves and loads: every `progress_interval_s` while one runs, rank 0
prints the bytes it has moved (its own shard), its MiB/s and the elapsed time, saying what it
counted (`verb`, `note`; process/wire_meter.py's `progress_measure`): never bytes handed to the
client's buffers, which run far ahead of the link (issue 31 item 3). A daemon thread reads the
counters: the timed operation pays a wake-up every few seconds (measured: README, "What the
harness costs").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dcp_fsdp.units import MIB

# Nothing moved for this long: the line says so (a dead or stalled endpoint: s3fs retries a
# refused connection for about 20 s with its defaults, and a user saw "uploaded 22.7 of
# 1262.6 MiB" repeated with no hint, issue 49)
STILL_S = 10.0


@dataclass
class Heartbeat:
    what: str
    bytes_so_far: Callable[[], int] | None
    expected_bytes: int | None
    interval_s: float
    say: Callable[[str], None]
    verb: str = "moved"  # what the figure is: "uploaded", "received", "handed", ...
    note: str = ""  # how it was measured, said after the rate
    on_start: Callable[[], None] | None = None  # the counter's zero, taken when the operation starts
    beats: int = field(default=0, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _last_moved: int | None = field(default=None, init=False)  # the count at the last change, and when
    _since_s: float = field(default=0.0, init=False)

    def line(self, elapsed_s: float) -> str:
        if self.bytes_so_far is None:  # bytes move in another process (process checkpointer)
            return f"{self.what}: still running after {elapsed_s:.1f} s"
        moved = self.bytes_so_far()
        amount = f"{moved / MIB:.1f} MiB"
        if self.expected_bytes and moved <= self.expected_bytes:
            amount = f"{moved / MIB:.1f} of {self.expected_bytes / MIB:.1f} MiB"
        elif self.expected_bytes:
            # more than the rank's share of the state: a load that reads saved items whole
            # for parts of them (a resharded one), or re-reads; "N of M" would read as nonsense
            amount += f" (its share of the state: {self.expected_bytes / MIB:.1f} MiB)"
        rate = moved / MIB / elapsed_s if elapsed_s > 0 else 0.0
        note = f"; {self.note}" if self.note else ""
        return (f"{self.what}: still running, rank 0 {self.verb} {amount}"
                f" in {elapsed_s:.1f} s ({rate:.1f} MiB/s{note}){self._still(moved, elapsed_s)}")

    def _still(self, moved: int, elapsed_s: float) -> str:
        """A hint when nothing has moved for STILL_S or more."""
        if moved != self._last_moved:
            self._last_moved, self._since_s = moved, elapsed_s
            return ""
        still_s = elapsed_s - self._since_s
        if still_s < STILL_S:
            return ""
        return (f"; nothing moved for {still_s:.0f} s: the endpoint may be down or stalled, "
                "the client retrying (op_timeout_s ends the operation)")

    def _run(self, started: float) -> None:
        if self.on_start is not None:
            self.on_start()  # here, not in the timed thread: a missed instant counts short
        while not self._stop.wait(self.interval_s):
            self.beats += 1
            self.say(self.line(time.monotonic() - started))

    def __enter__(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._run, args=(time.monotonic(),),
                                        name="dcp-fsdp-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
