"""Which failed loads are probed for a checkpoint deleted under them (rank/loop.py)."""

from __future__ import annotations

import pytest

from dcp_fsdp.rank.loop import _says_missing


def _raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise RuntimeError("DCP: reading failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("error", [
    RuntimeError("Service error: NoSuchKey"),
    RuntimeError("HTTP 404 Not Found"),
    FileNotFoundError("gone"),
    _raised_from(FileNotFoundError("a shard file")),
    _raised_from(OSError("Client error: The specified key does not exist")),
])
def test_an_error_that_says_something_is_missing_is_probed(error):
    assert _says_missing(error)


@pytest.mark.parametrize("error", [
    RuntimeError("read 1.404 MiB in 0.404 s, then the connection was reset"),
    RuntimeError("Service error: SlowDown (503)"),
    _raised_from(ConnectionResetError("reset by peer")),
])
def test_other_errors_are_not(error):
    assert not _says_missing(error)


def test_a_chain_that_loops_back_ends():
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert not _says_missing(first)
