"""The signals that end a rank, and what each means: Ctrl-C and SIGTERM end the run as
`interrupted`; a SIGTERM that finds a sibling rank already ended (torch's agent stopping
the survivors) means a peer failed first (`peers.py`)."""

from __future__ import annotations

import signal

from dcp_fsdp import contract
from dcp_fsdp.process import peers  # first in a rank: it notes this rank's agent at import


class Terminated(BaseException):
    """SIGTERM (scancel, torchrun stopping the group): end like Ctrl-C."""


class PeerFailed(BaseException):
    """The launcher stopped this rank because another rank had failed."""


class InterruptGuard:
    """SIGINT / SIGTERM end the run as `interrupted`, whatever code they land in.

    The first signal raises (KeyboardInterrupt / Terminated) so the rank leaves the
    operation it is in; DCP may catch that and re-raise it wrapped in a
    CheckpointException, so the signal is also remembered here. Later signals (the
    terminal's Ctrl-C and the launcher's forwarded one both arrive) are only noted:
    they must not cut the record being written.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.ended_peers: list[int] = []  # ranks of this node gone when a SIGTERM came
        self.finishing = False  # the run has its outcome: a signal now must not cut the record

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(getattr(signal, contract.PEER_FAILED_SIGNAL_NAME), self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is not None or self.finishing:
            return
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            # torch's elastic agent stops the survivors with SIGTERM when a rank ended
            # first: that run failed, it was not interrupted (dcp_fsdp/process/peers.py).
            self.ended_peers = peers.ended_local_peers()
            if self.ended_peers:
                self.signal_name = contract.PEER_FAILED_SIGNAL_NAME
        if self.signal_name == contract.PEER_FAILED_SIGNAL_NAME:
            raise PeerFailed()
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
