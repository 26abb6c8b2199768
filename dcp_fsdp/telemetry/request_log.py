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
event hook (`control_plane.py`) counts them per attempt, kept apart from the
connector's requests. Summaries of windows: `summaries.py`.
"""

from __future__ import annotations

import datetime
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Iterable

from dcp_fsdp import log
from dcp_fsdp.process.lifeline import owned_tempdir
from dcp_fsdp.telemetry import summaries
from dcp_fsdp.telemetry.control_plane import install_control_plane_hook
from dcp_fsdp.telemetry.request import THROTTLE_STATUSES, Request  # noqa: F401 - re-exported

DEBUG_LOGS_ENV = "S3_TORCH_CONNECTOR_DEBUG_LOGS"
LOGS_DIR_ENV = "S3_TORCH_CONNECTOR_LOGS_DIR_PATH"
LOG_FILTER = "debug,awscrt=off"  # the connector's request lines; none of the CRT's own

# The connector logs some requests as request_type=Default; its span names what they were.
_DEFAULT_BY_SPAN = {"delete_object": "DeleteObject", "list_objects": "ListObjectsV2",
                    "delete_objects": "DeleteObjects", "get_object_attributes": "GetObjectAttributes",
                    "rename_object": "RenameObject"}

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
        self._warned_unparsed = False

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
        inside: list[Request] = []
        for item in items:
            (inside if begin <= item.end_wall_s <= end else untimed).append(item)
        return inside

    def window(self, begin_wall_s: float, end_wall_s: float,
               bytes_up: int | None = None, moved_bytes: int | None = None
               ) -> dict[str, Any] | None:
        """Summary of the requests that ended within [begin, end]; earlier ones go untimed.

        Call right after the timed operation, before any further request. `moved_bytes`:
        what the operation moved; when it moved some and no request was parsed, the log no
        longer reads as we expect (a connector release reworded it): None (unknown), never
        a summary of zero requests and zero failures, and one warning per process.
        Requests that ended after `end` stay for the next window: an async save with
        steps between saves is summarised once its upload is done, after the next save began.
        """
        self._read_new()
        pending = [r for r in self._pending if r.end_wall_s <= end_wall_s]
        self._pending = [r for r in self._pending if r.end_wall_s > end_wall_s]
        with self._control_lock:
            control = [c for c in self._control if c.end_wall_s <= end_wall_s]
            self._control = [c for c in self._control if c.end_wall_s > end_wall_s]
        timed = self._split(pending, begin_wall_s, end_wall_s, self.untimed)
        timed_control = self._split(control, begin_wall_s, end_wall_s, self.untimed_control)
        if moved_bytes and not timed:
            self._warn_unparsed()
            return None
        return summaries.summarize(timed, end_wall_s - begin_wall_s, bytes_up, timed_control)

    def _warn_unparsed(self) -> None:
        if self._warned_unparsed:
            return
        self._warned_unparsed = True
        from importlib import metadata

        try:
            version = metadata.version("s3torchconnector")
        except metadata.PackageNotFoundError:
            version = "unknown"
        log.warning(f"no S3 request was parsed from the log of s3torchconnector {version} "
                    "for an operation that moved bytes: request statistics are left empty "
                    "(unknown), not zero; this release may word its request lines "
                    "differently (telemetry/request_log.py)")

    def finish(self) -> dict[str, Any]:
        """Summary of everything outside the timed windows (call at the end of the run)."""
        self._read_new()
        self.untimed.extend(self._pending)
        self._pending = []
        with self._control_lock:
            self.untimed_control.extend(self._control)
            self._control = []
        return summaries.summarize(self.untimed, None, None, self.untimed_control)

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

    def environment(self) -> dict[str, str]:
        """What the connector must see in os.environ to log into this directory."""
        return {DEBUG_LOGS_ENV: LOG_FILTER, LOGS_DIR_ENV: str(self.directory)}

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


def open_for_rank(rank: int | str, keep_raw: bool = False) -> RequestLog | None:
    """This rank's request log, or None when it cannot be had (warned).

    The connector configures its logger once, when its native module is first
    imported: call this at rank start, apply `log.environment()` to os.environ, and
    only then import s3torchconnector.
    """
    from dcp_fsdp.compat import connector_native_loaded

    if connector_native_loaded():
        log.warning(f"rank {rank}: s3torchconnector was imported before the request log "
                    "could be enabled; S3 request statistics are not recorded")
        return None
    # Named after this process: a rank killed before close() leaves it, the next run
    # removes it (dcp_fsdp/process/lifeline.py).
    directory = owned_tempdir(f"dcp-fsdp-requests-r{rank}-")
    request_log = RequestLog(directory, keep_raw=keep_raw)
    install_control_plane_hook(request_log.record_control_call)
    return request_log
