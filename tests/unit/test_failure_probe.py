"""A failed operation probes the storage once per failure, not once per rank: the ranks'
outcome (rank/session.py's _outcome) with a store that counts its probes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsdp.errors import UserError
from dcp_fsdp.process import failures
from dcp_fsdp.process.signals import InterruptGuard
from dcp_fsdp.rank.session import _outcome

FULL = "the file system is full (No space left on device)"


class CountedStore:
    """A store whose probe finds the file system full, and counts how often it was asked."""

    def __init__(self) -> None:
        self.probes = 0
        self._lock = threading.Lock()

    def probe(self) -> None:
        with self._lock:
            self.probes += 1
        raise UserError(FULL)


def _rank(store, rank: int) -> Any:  # a RankSession as _outcome reads one
    """What _outcome reads of a joined rank's session."""
    return SimpleNamespace(store=store, ctx=object(), rank=rank, is_coordinator=rank == 0,
                           request_log=None)


def test_an_error_every_rank_raises_is_probed_once_by_the_coordinator():
    store = CountedStore()
    raised: dict[int, Any] = {3: RuntimeError("unexpected pos 2048 vs 1024")}  # as DCP gives it
    error = CheckpointException("save", raised)
    world_size = 1024
    endings = [_outcome(error, InterruptGuard(), _rank(store, rank)) for rank in range(world_size)]
    assert store.probes == 1
    lines = [ending.error_line or "" for ending in endings]
    assert lines[0].startswith(FULL)  # the line rank 0 prints and records
    assert "unexpected pos" in lines[0]
    assert all(not line.startswith(FULL) for line in lines[1:])
    assert {ending.status for ending in endings} == {"failed"}


def test_a_ranks_own_error_is_probed_by_that_rank():
    store = CountedStore()
    ending = _outcome(RuntimeError("unexpected pos"), InterruptGuard(), _rank(store, 5))
    assert store.probes == 1
    assert ending.error_line is not None
    assert ending.error_line.startswith(FULL)


def test_a_probe_that_hangs_is_given_up_within_its_deadline(monkeypatch):
    """An endpoint that accepts and never answers: the rank must still write its record
    before the agent's SIGTERM grace ends (process/signals.py)."""
    answered = threading.Event()

    class HangingStore:
        def probe(self) -> None:
            answered.wait(30)

    monkeypatch.setattr(failures, "PROBE_DEADLINE_S", 0.2)
    started = time.monotonic()
    try:
        ending = _outcome(RuntimeError("unexpected pos"), InterruptGuard(), _rank(HangingStore(), 0))
    finally:
        answered.set()
    assert time.monotonic() - started < 5
    assert ending.error_line is not None
    assert ending.error_line.startswith("the storage did not answer a probe within 0.2 s")
    assert ending.error_line.endswith("(RuntimeError: unexpected pos)")


def test_an_error_after_a_sibling_ended_is_a_consequence_not_the_cause(monkeypatch):
    """Rank 1 SIGKILLed: rank 0's gloo collective fails at once ("Connection closed by
    peer"), and under load its error file was stamped before the agent noticed rank 1's
    end, so the record named rank 0's lost connection. Seen with a sibling already ended,
    the error is the rank's stop (peer_ended), and the storage is not probed for it."""
    from dcp_fsdp import contract
    from dcp_fsdp.process import peers

    monkeypatch.setattr(peers, "ended_local_peers", lambda: [1])
    store = CountedStore()
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:48799")
    ending = _outcome(lost, InterruptGuard(), _rank(store, 0))
    assert ending.cause is contract.EndCause.PEER_ENDED and ending.status == "failed"
    assert ending.error_line is not None
    assert ending.error_line.startswith("stopped after rank 1 ended first")
    assert "says why): [gloo/transport/tcp/pair.cc:553] Connection closed by peer" in ending.error_line
    assert store.probes == 0
    # a settings error is every rank's own, whoever ended first
    assert _outcome(UserError("bad"), InterruptGuard(),
                    _rank(store, 0)).cause is contract.EndCause.USER_ERROR


def test_with_no_sibling_ended_the_ranks_error_is_its_own(monkeypatch):
    from dcp_fsdp import contract
    from dcp_fsdp.process import peers

    monkeypatch.setattr(peers, "ended_local_peers", lambda: [])
    ending = _outcome(RuntimeError("unexpected pos"), InterruptGuard(), _rank(CountedStore(), 0))
    assert ending.cause is contract.EndCause.ERROR
