"""Where a save's or load's time went, by who spent it (docs/metrics.md "Where the time
goes"): per rank and operation the duration is exactly plan_s + io_s + commit_s, and io_s
splits by who spends it (storage/timeline.py; PARTS)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import pandas as pd

from dcp_fsdp.telemetry.figures import as_frame, first_text, mean_or_nan

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# fresh pages per byte from which the allocator, not DCP's code, is named as the bound
ALLOCATOR_PAGES_PER_BYTE = 1.0


class Part(NamedTuple):
    field: str
    words: str  # what a user reads
    owner: str  # who spent it: "storage", "dcp", "copy", "commit"


PARTS = {
    "save": (Part("plan_s", "planning", "dcp"), Part("stage_s", "serialising", "dcp"),
             Part("upload_s", "in the storage client (uploads)", "storage"),
             Part("commit_s", "commit", "commit")),
    "load": (Part("plan_s", "planning", "dcp"),
             Part("storage_s", "in the storage client", "storage"),
             Part("deserialise_s", "deserialising", "dcp"),
             Part("target_copy_s", "copy into the live tensors", "copy"),
             Part("commit_s", "commit", "commit")),
}
OWNER_WORDS = {
    "storage": "the storage client (its network waits and its own copies)",
    "dcp": "DCP's own work",
    "copy": "the copy into the live tensors (host-to-device on a GPU)",
    "commit": "the commit (waiting for the slowest rank, .metadata)",
}


class TimeSplit(NamedTuple):
    op: str
    duration_s: float  # mean per rank and operation
    parts_s: dict[str, float]  # field -> mean seconds per rank and operation
    owners_s: dict[str, float]  # owner -> seconds
    fresh_pages_per_byte: float  # NaN where the samples have no fault counts
    bound: str  # "storage" | "dcp" | "copy" | "commit" | "allocator"
    reader: str | None = None  # loads through the tool's reader: "read_ahead=N"
    msc_reads: str | None = None  # MSC loads: "whole", "ranged" or "whole+ranged"
    cores_busy: float = math.nan  # the rank process's CPU seconds / seconds (cpu_s); NaN: unknown


def _mean(frame: pd.DataFrame, field: str) -> float:
    return mean_or_nan(frame[field]) if field in frame else math.nan


def _pooled_ratio(frame: pd.DataFrame, field: str, per: str) -> float:
    """sum(field) / sum(per) over the samples that have `field` and a positive `per` (NaN: none)."""
    if field not in frame or frame.empty:
        return math.nan
    values = pd.to_numeric(frame[field], errors="coerce")
    have = values.notna() & (frame[per] > 0)
    if not have.any():
        return math.nan
    return float(values[have].sum() / frame.loc[have, per].sum())


def fresh_pages_per_byte(frame: pd.DataFrame) -> float:
    """Minor faults x page size / bytes over the samples that have both (NaN: none)."""
    return _pooled_ratio(frame, "minor_faults", "bytes") * PAGE_BYTES


def cores_busy(frame: pd.DataFrame) -> float:
    """CPU seconds / seconds over the samples that have cpu_s (NaN: none)."""
    return _pooled_ratio(frame, "cpu_s", "duration_s")


def split(op: str, frame: pd.DataFrame) -> TimeSplit | None:
    """The split of one op's samples (a frame of Sample fields); None where the samples
    lack it (an untimed writer or reader: harness_off=hooks, an async save's daemon)."""
    parts = PARTS.get(op)
    if "save_mode" in frame:  # an async save's duration is not its hooks' spans
        frame = frame[frame["save_mode"] != "async"]
    if parts is None or frame.empty:
        return None
    parts_s = {part.field: _mean(frame, part.field) for part in parts}
    if any(math.isnan(seconds) for field, seconds in parts_s.items() if field != "target_copy_s"):
        return None
    parts_s = {k: (0.0 if math.isnan(v) else v) for k, v in parts_s.items()}
    owners_s: dict[str, float] = {}
    for part in parts:
        owners_s[part.owner] = owners_s.get(part.owner, 0.0) + parts_s[part.field]
    pages = fresh_pages_per_byte(frame)
    bound = max(owners_s, key=lambda owner: owners_s[owner])
    if bound == "dcp" and not math.isnan(pages) and pages >= ALLOCATOR_PAGES_PER_BYTE:
        bound = "allocator"
    return TimeSplit(op, _mean(frame, "duration_s"), parts_s, owners_s, pages, bound,
                     first_text(frame, "reader"), first_text(frame, "msc_reads"), cores_busy(frame))


MSC_READS = {"whole": "MSC downloaded each object whole (under its 512 MiB switch)",
             "ranged": "MSC read by a ranged GET per read (objects above its 512 MiB switch)",
             "whole+ranged": "MSC downloaded the objects under its 512 MiB switch whole and "
                             "read those above it by a ranged GET per read"}


def _share(seconds: float, total: float) -> str:
    return f"{seconds:.3f} s ({100 * seconds / total:.0f} %)" if total > 0 else f"{seconds:.3f} s"


def split_line(found: TimeSplit) -> str:
    """One line: where a rank's mean operation went, and what bounds it."""
    total = sum(found.parts_s.values())
    cells = [f"{part.words} {_share(found.parts_s[part.field], total)}" for part in PARTS[found.op]
             if part.field != "target_copy_s" or found.parts_s[part.field] != 0.0]
    pages = ("" if math.isnan(found.fresh_pages_per_byte)
             else f"; {found.fresh_pages_per_byte:.2f} fresh pages per byte")
    label = found.op if found.reader is None else (
        f"{found.op} (the tool's reader, {found.reader}, not DCP's: fetching overlaps the rest)")
    if not math.isnan(found.cores_busy):
        pages += f"; {found.cores_busy:.2f} cores busy"
    if found.msc_reads in MSC_READS:
        pages += f"; {MSC_READS[found.msc_reads]}"
    return (f"{label}: {found.duration_s:.3f} s per rank = " + ", ".join(cells) + pages
            + f". {bound_words(found)}")


def bound_words(found: TimeSplit) -> str:
    total = sum(found.owners_s.values())
    if found.bound == "allocator":
        dcp_s = found.owners_s["dcp"]
        return (f"Bound by the allocator: DCP's own work took {_share(dcp_s, total)} with "
                f"{found.fresh_pages_per_byte:.2f} fresh pages per byte (its bytes landed in "
                "memory the kernel faulted in afresh); docs/metrics.md \"The allocator\"")
    seconds = found.owners_s[found.bound]
    hint = {"storage": "faster storage, more connections or more ranks per node help",
            "dcp": "storage is not the limit: DCP's serial reader/writer is",
            "copy": "the device copy is the limit (pageable memory, synchronous)",
            "commit": "the ranks wait for the slowest one, or for .metadata"}[found.bound]
    return f"Bound by {OWNER_WORDS[found.bound]}: {_share(seconds, total)}; {hint}"


def split_lines(samples: Iterable[dict[str, Any]] | pd.DataFrame) -> list[str]:
    """One line per op ("save", "load") of the samples that have the split."""
    frame = as_frame(samples)
    if frame.empty or "op" not in frame:
        return []
    found = (split(op, frame[frame["op"] == op]) for op in ("save", "load"))
    return [split_line(each) for each in found if each is not None]
