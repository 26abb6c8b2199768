"""Lines that say what a figure holds beyond the operation it names (printed under the
end-of-run table and in `dcp-fsdp report`'s notes)."""

from __future__ import annotations

from typing import Iterable

STAGER_RENEWED = (
    "async saves on a torch whose stager stages only once (2.11, pytorch/pytorch#183413): "
    "each save ran on a fresh stager, so its staging allocated its pinned / shared host "
    "buffers again (inside staged_s and stall_s); with a torch that reuses its stager only "
    "the first save pays that (sample field stager_renewed)")


def stager_note(renewed: Iterable[object]) -> str | None:
    """The note when any async save's `stager_renewed` is true (None, NaN or false: none;
    a pandas column may hold numpy booleans)."""
    marked = any(bool(value) for value in renewed if value is not None and value == value)
    return STAGER_RENEWED if marked else None


def fork_note(rank_starts: Iterable[object]) -> str | None:
    """The caution when any run's ranks were forked (rank_start=fork): they share a server's pages."""
    forked = sum(start == "fork" for start in rank_starts)
    if not forked:
        return None
    return (f"{forked} run(s) with forked ranks (rank_start=fork: the test suite's "
            "DCP_FSDP_TEST_ONLY_FORK_RANKS=1, not the process a user runs): their timings are "
            "not a user's; they are never pooled with exec'd runs (column rank_start)")
