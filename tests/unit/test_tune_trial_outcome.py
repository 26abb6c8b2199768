"""A tune trial's outcome (rank/tune_trials.py `_run_trial`): a failure every rank raises
alike ends the trial as failed; an interrupt, or a failure on a rank already signalled (a
Ctrl-C reaches the ranks one by one: the first to stop breaks the others' collective), ends
the whole session, which records it as interrupted (CI saw a cut tune's trial recorded as
failed)."""

from __future__ import annotations

import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsdp.errors import BenchmarkFailure
from dcp_fsdp.process.signals import InterruptGuard
from dcp_fsdp.rank.tune_trials import _run_trial


class RaisingLoop:
    """The part of a CheckpointLoop a trial runs: run(), here raising `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def run(self) -> None:
        if self.error is not None:
            raise self.error


def collective_failure() -> CheckpointException:
    """What DCP raises on every rank when a peer's part of a collective step broke."""
    error = RuntimeError("Connection closed by peer [127.0.0.1]:4000")
    return CheckpointException("save", {0: (error, traceback.extract_stack())})


def guard(signal_name: str | None) -> InterruptGuard:
    held = InterruptGuard()
    held.signal_name = signal_name
    return held


def test_a_trial_that_runs_is_ok():
    assert _run_trial(RaisingLoop(None), guard(None)) == ("ok", None)  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [collective_failure(), BenchmarkFailure("verification failed")])
def test_a_failure_every_rank_raises_ends_the_trial_only(error):
    status, line = _run_trial(RaisingLoop(error), guard(None))  # type: ignore[arg-type]
    assert status == "failed" and line


@pytest.mark.parametrize("error", [collective_failure(), BenchmarkFailure("verification failed")])
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_failure_on_a_signalled_rank_ends_the_session(error, signal_name):
    with pytest.raises(type(error)):
        _run_trial(RaisingLoop(error), guard(signal_name))  # type: ignore[arg-type]


def test_an_interrupt_ends_the_session():
    with pytest.raises(KeyboardInterrupt):
        _run_trial(RaisingLoop(KeyboardInterrupt()), guard("SIGINT"))  # type: ignore[arg-type]
