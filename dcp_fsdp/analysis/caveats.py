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
