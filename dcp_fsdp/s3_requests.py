"""S3 request statistics from the connector's own per-request log lines.

s3torchconnector has no statistics API, but its native client logs one line per
HTTP request when `S3_TORCH_CONNECTOR_DEBUG_LOGS` is set, into hourly files under
`S3_TORCH_CONNECTOR_LOGS_DIR_PATH`. The logger is configured once, when the
native module is first imported, so `enable()` must run at rank start, before
anything imports s3torchconnector. Each rank gets its own directory (processes
sharing one would interleave lines).

A line looks like (one line, wrapped here):
    2026-11-22T23:14:27.131010Z DEBUG put_object{id=1 bucket="b" key="k"}:
    mountpoint_s3_client::s3_crt_client: S3 request finished request_type=UploadPart
    crt_error=None http_status=200 range=None duration=120.88ms ttfb=Some(98.5ms) request_id=..
Its timestamp is UTC wall-clock time taken when the request ended, the same clock
as `time.time()`, so a request belongs to the timed operation whose
[begin_wall_s, end_wall_s] holds it; all others are "untimed".

Classification of one request (an HTTP attempt; retries are separate attempts):
  ok        "S3 request finished" (HTTP 2xx)
  miss      "S3 request failed" with 404 on HeadObject: an existence check whose
            answer is "no" (DCP's writer checks `.metadata` before writing it). Expected,
            not a failure.
  failed    any other "S3 request failed": HTTP 4xx/5xx, or no response at all
            (connection refused, timeout: status "none").
  throttled failed with HTTP 503 (S3's SlowDown) or 429.
  retried   a failed attempt the client tried again: a retryable failure (no response,
            5xx, 408, 429) that was not the last attempt of a request that failed.
  canceled  "S3 request canceled" (the client gave up on it, e.g. a reader closed
            early): neither ok nor failed.
  success_ratio = (requests - failed) / requests  (misses count as answered).

Control-plane calls our tool makes with boto3 (head_bucket, list_objects_v2,
put_object of the manifest, ...) do not pass through the connector's log; a boto3
event hook counts them per attempt (`control_plane`), kept apart from the
connector's requests.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

DEBUG_LOGS_ENV = "S3_TORCH_CONNECTOR_DEBUG_LOGS"
LOGS_DIR_ENV = "S3_TORCH_CONNECTOR_LOGS_DIR_PATH"
LOG_FILTER = "debug,awscrt=off"  # the connector's request lines; none of the CRT's own
NATIVE_MODULE = "s3torchconnectorclient._mountpoint_s3_client"

HIST_BUCKETS_PER_DECADE = 20  # bucket edges 10**(i/20) ms: values within +-6 % of the edge midpoint
HIST_MIN_MS = 1e-3
QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
THROTTLE_STATUSES = (429, 503)

# The connector logs some requests as request_type=Default; its span names what they were.
_DEFAULT_BY_SPAN = {"delete_object": "DeleteObject", "list_objects": "ListObjectsV2",
                    "delete_objects": "DeleteObjects", "get_object_attributes": "GetObjectAttributes",
                    "rename_object": "RenameObject"}

# How SeaweedFS's SeaweedFS_s3_request_total{type} names what a client sent.
SERVER_TYPE = {
    "CreateMultipartUpload": "POST", "CompleteMultipartUpload": "POST", "UploadPart": "PUT",
    "PutObject": "PUT", "GetObject": "GET", "HeadObject": "GET", "CopyObject": "COPY",
    "UploadPartCopy": "PUT", "DeleteObject": "DELETE", "AbortMultipartUpload": "DELETE",
    "ListObjectsV2": "LIST", "ListParts": "GET", "HeadBucket": "GET",
}

_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)\s+(?P<level>[A-Z]+)\s+(?P<rest>.*)$")
_REQUEST = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): S3 request "
                      r"(?P<outcome>finished|failed|canceled) (?P<fields>.*)$")
_META = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): (?:.* )?meta request (?P<end>finished|failed|canceled)")
_NEW = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): new request$")
_TYPE = re.compile(r"\brequest_type=(\w+)")
_STATUS = re.compile(r"\bhttp_status=(\d+)")
_RANGE = re.compile(r"\brange=Some\((\d+)\.\.(\d+)\)")
_DURATION = re.compile(r"\bduration=([\d.]+)(ns|µs|us|ms|s)\b")
_TTFB = re.compile(r"\bttfb=Some\(([\d.]+)(ns|µs|us|ms|s)\)")
_KEY = re.compile(r'\b(?:destination_)?key="((?:[^"\\]|\\.)*)"')
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclasses.dataclass(slots=True)
class Request:
    """One HTTP attempt the connector made (or a control-plane call, kind prefixed)."""

    end_wall_s: float  # when it ended (log timestamp), epoch seconds
    kind: str  # CreateMultipartUpload, UploadPart, GetObject, HeadObject, DeleteObject, ...
    outcome: str  # ok | miss | failed | canceled
    status: int | None  # HTTP status; None when no response arrived
    duration_s: float | None
    ttfb_s: float | None = None
    nbytes: int | None = None  # GetObject: bytes in the requested range
    retryable: bool = False
    retried: bool = False
    key: str | None = None

    @property
    def throttled(self) -> bool:
        return self.outcome == "failed" and self.status in THROTTLE_STATUSES


def _seconds(value: str, unit: str) -> float:
    return float(value) * _UNIT_S[unit]


def _epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _span_name(span: str) -> str:
    # "put_object{id=1 ...}" (or nested "outer{..}:put_object{..}"): the innermost name
    last = span.rsplit("}:", 1)[-1]
    return last.split("{", 1)[0].strip()


def request_kind(request_type: str, span: str) -> str:
    if request_type == "Default":
        name = _span_name(span)
        return _DEFAULT_BY_SPAN.get(name, f"Default:{name}")
    return request_type


def classify(kind: str, finished: str, status: int | None) -> str:
    """ok | miss | failed | canceled (see the module docstring)."""
    if finished == "finished":
        return "ok"
    if finished == "canceled":
        return "canceled"
    if status == 404 and kind == "HeadObject":
        return "miss"
    return "failed"


def _retryable(status: int | None) -> bool:
    return status is None or status >= 500 or status in (408, 429)


class LogParser:
    """Turns connector log lines into Requests, tracking each meta request for retries."""

    def __init__(self) -> None:
        self._attempts: dict[str, list[Request]] = {}  # span -> attempts of its meta request

    def feed(self, line: str) -> Request | None:
        match = _LINE.match(line)
        if not match:
            return None
        rest = match["rest"]
        request = _REQUEST.match(rest)
        if request is None:
            if rest.endswith("new request"):
                new = _NEW.match(rest)
                if new:
                    self._attempts.pop(new["span"], None)
            elif "meta request" in rest:
                meta = _META.match(rest)
                if meta:
                    attempts = self._attempts.pop(meta["span"], [])
                    if meta["end"] == "failed" and attempts:
                        last = attempts[-1]
                        if last.outcome == "failed" and last.retryable:
                            last.retried = False  # the final attempt: given up, not retried
            return None
        fields = request["fields"]
        kind_match = _TYPE.search(fields)
        kind = request_kind(kind_match[1] if kind_match else "Unknown", request["span"])
        status_match = _STATUS.search(fields)
        status = int(status_match[1]) if status_match else None
        outcome = classify(kind, request["outcome"], status)
        duration = _DURATION.search(fields)
        ttfb = _TTFB.search(fields)
        byte_range = _RANGE.search(fields)
        key = _KEY.search(request["span"])
        item = Request(
            end_wall_s=_epoch(match["ts"]), kind=kind, outcome=outcome, status=status,
            duration_s=_seconds(*duration.groups()) if duration else None,
            ttfb_s=_seconds(*ttfb.groups()) if ttfb else None,
            nbytes=(int(byte_range[2]) - int(byte_range[1])) if byte_range else None,
            key=key[1] if key else None)
        if outcome == "failed" and _retryable(status):
            item.retryable = True
            item.retried = True  # until its meta request turns out to have failed on it
        self._attempts.setdefault(request["span"], []).append(item)
        return item


def parse_lines(lines: Iterable[str]) -> list[Request]:
    parser = LogParser()
    return [r for r in (parser.feed(line) for line in lines) if r is not None]


# -- histograms (mergeable across ranks, runs and iterations) -----------------------------

def hist_bucket(value_ms: float) -> int:
    value_ms = max(value_ms, HIST_MIN_MS)
    return math.floor(math.log10(value_ms) * HIST_BUCKETS_PER_DECADE + 1e-9)


def bucket_bounds_ms(index: int) -> tuple[float, float]:
    return (10 ** (index / HIST_BUCKETS_PER_DECADE), 10 ** ((index + 1) / HIST_BUCKETS_PER_DECADE))


def histogram(values_ms: Iterable[float]) -> dict[str, int]:
    counts = collections.Counter(hist_bucket(v) for v in values_ms)
    return {str(index): counts[index] for index in sorted(counts)}


def hist_merge(histograms: Iterable[dict[str, int] | None]) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for hist in histograms:
        for index, count in (hist or {}).items():
            total[int(index)] += int(count)
    return {str(index): total[index] for index in sorted(total)}


def hist_quantile(hist: dict[str, int], q: float) -> float | None:
    """Approximate quantile (ms): the geometric middle of the bucket holding it."""
    items = sorted((int(index), count) for index, count in hist.items() if count)
    total = sum(count for _, count in items)
    if not total:
        return None
    rank = q * (total - 1)
    seen = 0
    for index, count in items:
        seen += count
        if seen > rank:
            low, high = bucket_bounds_ms(index)
            return math.sqrt(low * high)
    low, high = bucket_bounds_ms(items[-1][0])
    return math.sqrt(low * high)


def _percentiles_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    ordered = sorted(v * 1e3 for v in values_s)
    found = {}
    for name, q in QUANTILES.items():
        # linear interpolation between closest ranks (numpy's default)
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        found[name] = round(ordered[low] + (ordered[high] - ordered[low]) * (position - low), 4)
    found["max"] = round(ordered[-1], 4)
    return found


# -- summaries ---------------------------------------------------------------------------

def summarize(requests: list[Request], seconds: float | None = None,
              bytes_up: int | None = None,
              control_plane: list[Request] | None = None) -> dict[str, Any]:
    """Figures for one window (one rank's save or load, or everything untimed).

    `seconds`: the window's length, for req_per_s. `bytes_up`: bytes this rank wrote
    into objects (the connector's log does not give upload sizes).
    """
    count = len(requests)
    failed = sum(r.outcome == "failed" for r in requests)
    status = collections.Counter("none" if r.status is None else str(r.status) for r in requests)
    by_type: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind for r in requests}):
        rows = [r for r in requests if r.kind == kind]
        durations = [r.duration_s for r in rows if r.duration_s is not None]
        entry: dict[str, Any] = {
            "count": len(rows),
            "failed": sum(r.outcome == "failed" for r in rows),
            "misses": sum(r.outcome == "miss" for r in rows),
            "throttled": sum(r.throttled for r in rows),
            "retries": sum(r.retried for r in rows),
            "status": dict(sorted(collections.Counter(
                "none" if r.status is None else str(r.status) for r in rows).items())),
            "latency_ms": _percentiles_ms(durations),
            "latency_hist": histogram(d * 1e3 for d in durations),
        }
        sizes = [r.nbytes for r in rows if r.nbytes is not None]
        if sizes:
            entry["bytes"] = sum(sizes)
        by_type[kind] = entry
    durations = [r.duration_s for r in requests if r.duration_s is not None]
    ttfbs = [r.ttfb_s for r in requests if r.ttfb_s is not None]
    summary: dict[str, Any] = {
        "count": count,
        "ok": sum(r.outcome == "ok" for r in requests),
        "failed": failed,
        "misses": sum(r.outcome == "miss" for r in requests),
        "throttled": sum(r.throttled for r in requests),
        "retries": sum(r.retried for r in requests),
        "canceled": sum(r.outcome == "canceled" for r in requests),
        "success_ratio": round((count - failed) / count, 6) if count else None,
        "seconds": seconds,
        "req_per_s": round(count / seconds, 3) if count and seconds else None,
        "bytes_down": sum(r.nbytes or 0 for r in requests if r.kind == "GetObject"),
        "bytes_up": bytes_up,
        "status": dict(sorted(status.items())),
        "latency_ms": _percentiles_ms(durations),
        "ttfb_ms": _percentiles_ms(ttfbs),
        "ttfb_hist": histogram(t * 1e3 for t in ttfbs),
        "by_type": by_type,
    }
    if control_plane:
        summary["control_plane"] = control_plane_counts(control_plane)
    return summary


def control_plane_counts(calls: list[Request]) -> dict[str, dict[str, int]]:
    """{"HeadBucket": {"200": 1}, ...}: boto3 calls per operation and HTTP status."""
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for call in calls:
        found[call.kind]["none" if call.status is None else str(call.status)] += 1
    return {kind: dict(sorted(counts.items())) for kind, counts in sorted(found.items())}


def merge_summaries(summaries: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Add up counts of several summaries (e.g. every rank's untimed requests)."""
    summaries = [s for s in summaries if s]
    if not summaries:
        return None
    merged: dict[str, Any] = {key: sum(s.get(key) or 0 for s in summaries)
                              for key in ("count", "ok", "failed", "misses", "throttled",
                                          "retries", "canceled", "bytes_down")}
    merged["success_ratio"] = (round((merged["count"] - merged["failed"]) / merged["count"], 6)
                               if merged["count"] else None)
    status: collections.Counter = collections.Counter()
    by_type: dict[str, dict[str, Any]] = {}
    control: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for summary in summaries:
        status.update(summary.get("status") or {})
        for kind, entry in (summary.get("by_type") or {}).items():
            into = by_type.setdefault(kind, {"count": 0, "failed": 0, "misses": 0,
                                             "throttled": 0, "retries": 0, "status": {},
                                             "latency_hist": {}})
            for key in ("count", "failed", "misses", "throttled", "retries"):
                into[key] += entry.get(key) or 0
            into["status"] = dict(sorted((collections.Counter(into["status"])
                                          + collections.Counter(entry.get("status") or {})).items()))
            into["latency_hist"] = hist_merge([into["latency_hist"], entry.get("latency_hist")])
        for kind, counts in (summary.get("control_plane") or {}).items():
            control[kind].update(counts)
    merged["status"] = dict(sorted(status.items()))
    merged["by_type"] = dict(sorted(by_type.items()))
    if control:
        merged["control_plane"] = {k: dict(sorted(v.items())) for k, v in sorted(control.items())}
    return merged


def server_view(by_type: dict[str, dict[str, Any]] | None = None,
                control_plane: dict[str, dict[str, int]] | None = None) -> collections.Counter:
    """What SeaweedFS should count for these requests: {(server type, code): n}.

    `by_type`: a summary's by_type (each kind's `status` counts); `control_plane`:
    boto3 calls per operation and status. SeaweedFS names HEAD as GET, UploadPart
    as PUT, Create/CompleteMultipartUpload as POST (see SERVER_TYPE).
    """
    view: collections.Counter = collections.Counter()
    for kind, entry in (by_type or {}).items():
        for code, n in (entry.get("status") or {}).items():
            view[(SERVER_TYPE.get(kind, kind), code)] += n
    for kind, per_status in (control_plane or {}).items():
        for code, n in per_status.items():
            view[(SERVER_TYPE.get(kind, kind), code)] += n
    return view


def parse_server_metrics(text: str, bucket: str | None = None) -> collections.Counter:
    """SeaweedFS_s3_request_total{bucket,code,type} from its Prometheus text: {(type, code): n}."""
    found: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if not line.startswith("SeaweedFS_s3_request_total{"):
            continue
        labels_text, _, value = line.partition("} ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
        if bucket is not None and labels.get("bucket") != bucket:
            continue
        found[(labels.get("type", "?"), labels.get("code", "?"))] += int(float(value))
    return found


# -- the per-process log -----------------------------------------------------------------

class RequestLog:
    """This process's connector log: read incrementally, split into timed windows."""

    def __init__(self, directory: Path, keep_raw: bool = False) -> None:
        self.directory = Path(directory)
        self.keep_raw = keep_raw
        self._offsets: dict[str, int] = {}
        self._parser = LogParser()
        self._pending: list[Request] = []  # read but not yet assigned to a window
        self.untimed: list[Request] = []
        self._control: list[Request] = []
        self._control_lock = threading.Lock()
        self.untimed_control: list[Request] = []

    def _read_new(self) -> None:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):  # hourly files sort by time
            if not path.is_file():
                continue
            offset = self._offsets.get(path.name, 0)
            with open(path, "rb") as source:
                source.seek(offset)
                data = source.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path.name] = offset + end + 1
            for line in data[:end].decode("utf-8", errors="replace").splitlines():
                request = self._parser.feed(line)
                if request is not None:
                    self._pending.append(request)

    def record_control_call(self, call: Request) -> None:
        with self._control_lock:
            self._control.append(call)

    def _split(self, items: list[Request], begin: float, end: float,
               untimed: list[Request]) -> list[Request]:
        inside = []
        for item in items:
            (inside if begin <= item.end_wall_s <= end else untimed).append(item)
        return inside

    def window(self, begin_wall_s: float, end_wall_s: float,
               bytes_up: int | None = None) -> dict[str, Any]:
        """Summary of the requests that ended within [begin, end]; earlier ones go untimed.

        Call right after the timed operation, before any further request.
        """
        self._read_new()
        pending, self._pending = self._pending, []
        with self._control_lock:
            control, self._control = self._control, []
        timed = self._split(pending, begin_wall_s, end_wall_s, self.untimed)
        timed_control = self._split(control, begin_wall_s, end_wall_s, self.untimed_control)
        return summarize(timed, end_wall_s - begin_wall_s, bytes_up, timed_control)

    def finish(self) -> dict[str, Any]:
        """Summary of everything outside the timed windows (call at the end of the run)."""
        self._read_new()
        self.untimed.extend(self._pending)
        self._pending = []
        with self._control_lock:
            self.untimed_control.extend(self._control)
            self._control = []
        return summarize(self.untimed, None, None, self.untimed_control)

    def copy_raw(self, destination: Path) -> Path | None:
        """The raw log lines (all hourly files, in order) into one file."""
        files = sorted(p for p in self.directory.glob("*") if p.is_file()) \
            if self.directory.is_dir() else []
        if not files:
            return None
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as out:
            for path in files:
                with open(path, "rb") as source:
                    shutil.copyfileobj(source, out)
        return destination

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self, results_dir: str | Path, run_id: str | None, rank: int | str) -> Path | None:
        """End of the rank: keep the raw log if asked (returns where), remove the temp dir."""
        kept = None
        if self.keep_raw and run_id:
            kept = self.copy_raw(Path(results_dir) / f"{run_id}.requests" /
                                 f"rank-{int(rank):05d}.log")
        self.remove()
        return kept


_active: RequestLog | None = None


def active() -> RequestLog | None:
    return _active


def enable(rank: int | str, keep_raw: bool = False) -> RequestLog | None:
    """Turn on the connector's request log for this process (call at rank start).

    Returns None (no request statistics) when the connector's native module is
    already loaded: its logger was configured then and cannot be redirected.
    """
    global _active
    if _active is not None:
        return _active
    if NATIVE_MODULE in sys.modules:
        print(f"dcp-fsdp: warning: rank {rank}: s3torchconnector was imported before the request "
              "log could be enabled; S3 request statistics are not recorded", file=sys.stderr)
        return None
    directory = Path(tempfile.mkdtemp(prefix=f"dcp-fsdp-requests-r{rank}-"))
    os.environ[DEBUG_LOGS_ENV] = LOG_FILTER
    os.environ[LOGS_DIR_ENV] = str(directory)
    _active = RequestLog(directory, keep_raw=keep_raw)
    _install_control_plane_hook(_active)
    return _active


def disable() -> None:
    """Forget the active log and remove its directory (tests; end of a rank)."""
    global _active
    if _active is not None:
        _active.remove()
    _active = None


def _install_control_plane_hook(log: RequestLog) -> None:
    """Count every boto3 S3 attempt (per attempt, with its status) made in this process."""
    try:
        import boto3
    except ImportError:
        return
    if boto3.DEFAULT_SESSION is None:
        boto3.setup_default_session()

    def on_attempt(event_name: str = "", response=None, caught_exception=None, **kwargs):
        operation = event_name.rsplit(".", 1)[-1]
        status = None
        if response is not None:
            try:
                status = int(response[0].status_code)
            except (AttributeError, IndexError, TypeError, ValueError):
                status = None
        outcome = ("ok" if status is not None and status < 400 else
                   "miss" if status == 404 and operation.startswith("Head") else "failed")
        log.record_control_call(Request(end_wall_s=time.time(), kind=operation, outcome=outcome,
                                        status=status, duration_s=None))
        return None  # never influences botocore's retry decision

    boto3.DEFAULT_SESSION.events.register("needs-retry.s3", on_attempt,
                                          unique_id="dcp-fsdp-control-plane-count")


def window(begin_wall_s: float, end_wall_s: float, bytes_up: int | None = None
           ) -> dict[str, Any] | None:
    """The active log's summary for one timed operation, or None when not enabled."""
    return None if _active is None else _active.window(begin_wall_s, end_wall_s, bytes_up)
