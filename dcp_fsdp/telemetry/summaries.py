"""Figures for one window of requests (one rank's save or load, or everything untimed),
and their sums across ranks (docs/metrics.md "S3 request statistics")."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Iterable

from dcp_fsdp.telemetry.connector_log import PARSER_FORMAT
from dcp_fsdp.telemetry.histograms import histogram, hist_merge, percentiles_ms

if TYPE_CHECKING:
    from dcp_fsdp.telemetry.request import Request

TYPE_COUNTS = ("count", "failed", "misses", "throttled", "retries")  # a by_type entry's counts


def summarize(requests: list["Request"], seconds: float | None = None,
              bytes_up: int | None = None,
              control_plane: list["Request"] | None = None, unparsed: int = 0,
              late: int | None = None) -> dict[str, Any]:
    """One window's figures. `seconds`: its length, for req_per_s; `bytes_up`: bytes this rank
    wrote into objects, where the requests do not carry their upload bodies' lengths;
    `unparsed`, `late` (untimed only): as the summary's fields."""
    count = len(requests)
    failed = sum(r.outcome == "failed" for r in requests)
    by_type = {kind: _type_entry([r for r in requests if r.kind == kind])
               for kind in sorted({r.kind for r in requests})}
    durations = [r.duration_s for r in requests if r.duration_s is not None]
    ttfbs = [r.ttfb_s for r in requests if r.ttfb_s is not None]
    summary: dict[str, Any] = {
        "count": count,
        "ok": sum(r.outcome == "ok" for r in requests),
        **_outcomes(requests),
        "canceled": sum(r.outcome == "canceled" for r in requests),
        "success_ratio": round((count - failed) / count, 6) if count else None,
        "seconds": seconds,
        "req_per_s": round(count / seconds, 3) if count and seconds else None,
        # the GETs' bodies that came whole, and what came of the broken ones where known
        "bytes_down": sum((r.nbytes or 0) if r.outcome == "ok" else (r.received or 0)
                          for r in requests if r.kind == "GetObject"),
        "broken": sum(r.broken for r in requests),
        "bytes_down_broken_max": sum(_unknown_body_bytes(r) for r in requests),
        "bytes_up": _uploaded_bytes(requests, bytes_up),
        "status": _statuses(requests),
        "latency_ms": percentiles_ms(durations),
        "ttfb_ms": percentiles_ms(ttfbs),
        "ttfb_hist": histogram(t * 1e3 for t in ttfbs),
        "by_type": by_type,
        "unparsed": unparsed,
        "parser": PARSER_FORMAT,
    }
    if late is not None:
        summary["late"] = late
    if control_plane:
        summary["control_plane"] = control_plane_counts(control_plane)
    return summary


def _uploaded_bytes(requests: Iterable["Request"], written: int | None) -> int | None:
    """What a save uploaded: its successful uploads' bodies where every one carries its length
    (botocore's hook), else `written`, what the rank's streams counted."""
    uploads = [r for r in requests if r.kind in ("PutObject", "UploadPart") and r.outcome == "ok"]
    if not uploads or any(r.nbytes is None for r in uploads):
        return written
    return sum(r.nbytes or 0 for r in uploads)


def _unknown_body_bytes(request: "Request") -> int:
    """At most how many bytes of a GET's body came down uncounted: the rest of its range of
    one that broke or was canceled, unless its client counted it all."""
    partial = request.broken or request.outcome == "canceled"
    if request.kind != "GetObject" or not partial or request.body_known:
        return 0
    return max(0, (request.nbytes or 0) - (request.received or 0))


def _outcomes(rows: list["Request"]) -> dict[str, int]:
    return {"failed": sum(r.outcome == "failed" for r in rows),
            "misses": sum(r.outcome == "miss" for r in rows),
            "throttled": sum(r.throttled for r in rows), "retries": sum(r.retried for r in rows)}


def _statuses(rows: list["Request"]) -> dict[str, int]:
    """Requests per HTTP status ("none": no answer came), by status."""
    return dict(sorted(collections.Counter(
        "none" if r.status is None else str(r.status) for r in rows).items()))


def _type_entry(rows: list["Request"]) -> dict[str, Any]:
    durations = [r.duration_s for r in rows if r.duration_s is not None]
    entry: dict[str, Any] = {
        "count": len(rows),
        **_outcomes(rows),
        "status": _statuses(rows),
        "latency_ms": percentiles_ms(durations),
        "latency_hist": histogram(d * 1e3 for d in durations),
    }
    sizes = [r.nbytes for r in rows if r.nbytes is not None and r.outcome == "ok"]
    sizes += [r.received for r in rows if r.outcome != "ok" and r.received is not None]
    if sizes:
        entry["bytes"] = sum(sizes)  # as bytes_down: whole bodies, broken ones' counted part
    return entry


def control_plane_counts(calls: list["Request"]) -> dict[str, dict[str, int]]:
    """{"HeadBucket": {"200": 1}, ...}: boto3 calls per operation and HTTP status."""
    return {kind: _statuses([c for c in calls if c.kind == kind]) for kind in sorted({c.kind for c in calls})}


def merge_summaries(summaries: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Add up counts of several summaries (e.g. every rank's untimed requests)."""
    present = [s for s in summaries if s]
    if not present:
        return None
    merged: dict[str, Any] = {key: sum(s.get(key) or 0 for s in present)
                              for key in ("count", "ok", "failed", "misses", "throttled",
                                          "retries", "canceled", "bytes_down", "unparsed",
                                          "broken", "bytes_down_broken_max")}
    if any("late" in s for s in present):
        merged["late"] = sum(s.get("late") or 0 for s in present)
    merged["parser"] = ",".join(sorted({str(s.get("parser")) for s in present}))
    merged["success_ratio"] = (round((merged["count"] - merged["failed"]) / merged["count"], 6)
                               if merged["count"] else None)
    status: collections.Counter = collections.Counter()
    control: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for summary in present:
        status.update(summary.get("status") or {})
        for kind, counts in (summary.get("control_plane") or {}).items():
            control[kind].update(counts)
    merged["status"] = dict(sorted(status.items()))
    merged["by_type"] = dict(sorted(merge_by_type(present).items()))
    if control:
        merged["control_plane"] = {k: dict(sorted(v.items())) for k, v in sorted(control.items())}
    return merged


def merge_by_type(summaries: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The `by_type` entries of several summaries (anything else skipped) added up per request
    type, the most requested type first (ties in the order they first appear)."""
    by_type: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        if not isinstance(summary, dict):
            continue
        for kind, entry in (summary.get("by_type") or {}).items():
            into = by_type.setdefault(kind, {**dict.fromkeys(TYPE_COUNTS, 0), "status": {},
                                             "latency_hist": {}})
            for key in TYPE_COUNTS:
                into[key] += entry.get(key) or 0
            into["status"] = dict(sorted((collections.Counter(into["status"])
                                          + collections.Counter(entry.get("status") or {})).items()))
            into["latency_hist"] = hist_merge([into["latency_hist"], entry.get("latency_hist")])
    return dict(sorted(by_type.items(), key=lambda item: -item[1]["count"]))
