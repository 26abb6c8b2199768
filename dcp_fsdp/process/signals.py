"""The signals that end a rank, and what each means: Ctrl-C and SIGTERM end the run as
`interrupted`; a SIGTERM that finds a sibling rank already ended (torch's agent stopping
the survivors) means a peer failed first (`peers.py`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable

from dcp_fsdp import contract
from dcp_fsdp.process import peers  # first in a rank: it notes this rank's agent at import


# After SIGINT / SIGTERM a rank has this long to leave what it was doing and record (twice
# this once it is writing its record) before the signal watcher ends it: below torch's
# agent's shutdown timeout (launch/local.py RANK_STOP_GRACE_S), which would SIGKILL it.
STUCK_AFTER_SIGNAL_S = 8.0
_PEER_FAILED = getattr(signal, contract.PEER_FAILED_SIGNAL_NAME)
_ENDING = (signal.SIGINT, signal.SIGTERM, _PEER_FAILED)


class Terminated(BaseException):
    """SIGTERM (scancel, torchrun stopping the group): end like Ctrl-C."""


class PeerFailed(BaseException):
    """The launcher stopped this rank because another rank had failed."""


_installed_guard: InterruptGuard | None = None  # the guard whose signals the hook drops


def own_the_unraisable_hook() -> None:
    """The process's one unraisable hook (cli.main installs it first thing; a rank's guard again)."""
    sys.unraisablehook = unraisable_hook


def unraisable_hook(unraisable: sys.UnraisableHookArgs) -> None:
    """An exception Python could not raise (else printed as "Exception ignored in ..."): a signal's,
    once the installed guard has noted it, dropped (the run still ends `interrupted`); another
    Ctrl-C raised again as a signal, to end the command with its one line; else as Python would."""
    noted = _installed_guard is not None and _installed_guard.signal_name is not None
    if noted and isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated, PeerFailed)):
        return
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        try:
            _interrupt_later()
        except KeyboardInterrupt:  # another Ctrl-C, here: where it cannot go either
            _interrupt_later()
        return
    sys.__unraisablehook__(unraisable)


def _interrupt_later() -> None:
    """SIGINT to this process from another thread, handled by the main thread once the hook
    has returned (raised in the hook itself, it could not propagate)."""
    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT), daemon=True).start()


class InterruptGuard:
    """SIGINT / SIGTERM end the run as `interrupted`, whatever code they land in: the first
    raises so the rank leaves the operation it is in, and is remembered (DCP may wrap it);
    later ones (the terminal's and the launcher's both arrive) must not cut the record."""

    def __init__(self, stuck_after_s: float = STUCK_AFTER_SIGNAL_S) -> None:
        self.signal_name: str | None = None
        self.ended_peers: list[int] = []  # ranks of this node gone when a SIGTERM came
        self.finishing = False  # the run has its outcome: a signal now must not cut the record
        self.stuck_after_s = stuck_after_s

    def install(self, on_stuck: Callable[[str], None] | None = None) -> None:
        """The handlers; with `on_stuck`, also a watcher that ends a process whose main thread
        is still running `stuck_after_s` after a signal (twice that once it is finishing):
        `on_stuck(signal name)` is called from the watcher's thread and must end the process."""
        for signum in _ENDING:
            signal.signal(signum, self._on_signal)
        global _installed_guard
        _installed_guard = self
        own_the_unraisable_hook()
        if on_stuck is None:
            return
        # A Python handler runs only between the main thread's bytecodes, never while it is
        # blocked in native code; the C-level handler writes each signal to the wakeup fd.
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd, on_stuck), daemon=True,
                         name="dcp-fsdp-signal-watch").start()

    def _watch(self, read_fd: int, on_stuck: Callable[[str], None]) -> None:
        while not set(os.read(read_fd, 64)) & set(_ENDING):
            pass
        deadline = time.monotonic() + self.stuck_after_s
        while time.monotonic() < deadline + (self.stuck_after_s if self.finishing else 0):
            time.sleep(0.05)
        on_stuck(self.signal_name or "SIGTERM")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None or self.finishing:
            return
        if frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            # Inside the import machinery an exception would be lost in an import lock's
            # callback, and nothing has run yet to record: end quietly.
            os._exit(contract.EXIT_FAILED if signum == _PEER_FAILED else contract.EXIT_INTERRUPTED)
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            # the agent stopping the survivors of a rank that ended first: failed (peers.py)
            self.ended_peers = peers.ended_local_peers()
            if self.ended_peers:
                self.signal_name = contract.PEER_FAILED_SIGNAL_NAME
        if self.signal_name == contract.PEER_FAILED_SIGNAL_NAME:
            raise PeerFailed()
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
