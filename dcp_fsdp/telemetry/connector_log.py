"""The parser of the connector's per-request log lines, tied to the releases it was checked on.

The lines are not an API: they are debug text of the mountpoint-s3-client bundled in
s3torchconnectorclient, and a partial rewording parses into wrong figures without a word.
Hence the parser runs only on CHECKED_RELEASES (`version_problem`); it is strict (a request
line lacking a field it needs, or carrying one in a shape it does not know, is `Unparsed`,
counted, never guessed at); and every summary names PARSER_FORMAT. The fields each line must
carry: docs/metrics.md "S3 request statistics". A line looks like (wrapped here):
    2026-11-22T23:14:27.131010Z DEBUG put_object{id=1 bucket="b" key="k"}:
    mountpoint_s3_client::s3_crt_client: S3 request finished request_type=UploadPart
    crt_error=None http_status=200 range=None duration=120.88ms ttfb=Some(98.5ms) request_id=..
"""

from __future__ import annotations

import dataclasses
import datetime
import re

from dcp_fsdp.compat import installed_version
from dcp_fsdp.telemetry.request import Request

# Bump when the parser's reading of a line changes; recorded with every request summary.
PARSER_FORMAT = "mountpoint-s3-client-debug/3"  # 3: "finished" with a crt_error is broken
# The releases whose lines this parser was checked against (the native client writes them)
CHECKED_RELEASES = {"s3torchconnectorclient": ("1.5.0",), "s3torchconnector": ("1.5.0",)}

# The connector logs some requests as request_type=Default; its span names what they were.
_DEFAULT_BY_SPAN = {"delete_object": "DeleteObject", "list_objects": "ListObjectsV2",
                    "delete_objects": "DeleteObjects", "get_object_attributes": "GetObjectAttributes",
                    "rename_object": "RenameObject"}
_DUR = r"([\d.]+)(ns|µs|us|ms|s)"
_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)\s+(?P<level>[A-Z]+)\s+(?P<rest>.*)$")
_REQUEST_WORDS = re.compile(r": S3 request (?:finished|failed|canceled) ")
_REQUEST = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): S3 request "
                      r"(?P<outcome>finished|failed|canceled) (?P<fields>.*)$")
_META = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): (?:.* )?meta request (?P<end>finished|failed|canceled)")
_NEW = re.compile(r"^(?P<span>.*?): (?P<target>[\w:]+): new request$")
_TYPE = re.compile(r"\brequest_type=(\w+)")
_STATUS = re.compile(r"\bhttp_status=(\S+)")
_RANGE = re.compile(r"\brange=(\S+)")
_RANGE_SOME = re.compile(r"^Some\((\d+)\.\.(\d+)\)$")
_DURATION = re.compile(r"\bduration=(\S+)")
_TTFB = re.compile(r"\bttfb=(\S+)")
_CRT_ERROR = re.compile(r"\bcrt_error=Some\(")
_KEY = re.compile(r'\b(?:destination_)?key="((?:[^"\\]|\\.)*)"')
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclasses.dataclass(slots=True)
class Unparsed:
    """A request line the parser could not read in full: counted, never guessed at."""

    end_wall_s: float | None  # its timestamp, when that much parsed
    reason: str  # the field it lacked or carried in an unknown shape
    opened_wall_s: float | None = None  # when its meta request began, if known

    @property
    def at_s(self) -> float | None:
        return self.end_wall_s if self.opened_wall_s is None else self.opened_wall_s


def version_problem() -> str | None:
    """Why this parser must not read the installed connector's log (None: it may)."""
    for package, checked in CHECKED_RELEASES.items():
        version = installed_version(package)
        if version not in checked:
            return (f"{package} {version} is not a release the request-log parser was checked "
                    f"against ({', '.join(checked)}): its request counts could be silently "
                    f"wrong; add request_stats=false, or install {package}=={checked[-1]}")
    return None


def _seconds(text: str) -> float | None:
    match = re.fullmatch(_DUR, text)
    return float(match[1]) * _UNIT_S[match[2]] if match else None


def _epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def request_kind(request_type: str, span: str) -> str:
    if request_type != "Default":
        return request_type
    # the span's innermost name: "put_object{id=1 ...}" (or nested "outer{..}:put_object{..}")
    name = span.rsplit("}:", 1)[-1].split("{", 1)[0].strip()
    return _DEFAULT_BY_SPAN.get(name, f"Default:{name}")


def classify(kind: str, finished: str, status: int | None, broken: bool = False) -> str:
    """ok | miss | failed | canceled (request_log.py); `broken`: a "finished" line that
    carries a crt_error (its transfer broke after the status arrived) is failed."""
    if finished == "finished":
        return "failed" if broken else "ok"
    if finished == "canceled":
        return "canceled"
    if status == 404 and kind == "HeadObject":
        return "miss"
    return "failed"


def _status(fields: str, outcome: str) -> tuple[int | None, str | None]:
    """(HTTP status, None) or (None, why the line is unparsed)."""
    found = _STATUS.search(fields)
    if found:
        return (int(found[1]), None) if found[1].isdigit() else (None, "http_status")
    if outcome == "canceled" or (outcome == "failed" and _CRT_ERROR.search(fields)
                                 and "INVALID_RESPONSE_STATUS" not in fields):
        return None, None  # no response arrived: no status to give
    return None, "http_status"


def _nbytes(fields: str, kind: str, outcome: str) -> tuple[int | None, str | None]:
    found = _RANGE.search(fields)
    if found is None:
        return None, "range"
    some = _RANGE_SOME.match(found[1])
    if some:
        return int(some[2]) - int(some[1]), None
    if found[1] != "None" or (kind == "GetObject" and outcome == "finished"):
        return None, "range"  # a GET's bytes come from its range: none is no figure
    return None, None


class LogParser:
    """Turns connector log lines into Requests (or Unparsed), tracking each meta request
    (a span) for retries and for the time it was opened."""

    def __init__(self) -> None:
        self._last_attempt: dict[str, Request] = {}  # span -> its meta request's latest attempt
        # meta requests begun and not ended yet: span -> when it began (its "new request")
        self.open_spans: dict[str, float] = {}

    def feed(self, line: str) -> Request | Unparsed | None:
        match = _LINE.match(line)
        if not match:
            return Unparsed(None, "timestamp") if _REQUEST_WORDS.search(line) else None
        rest = match["rest"]
        request = _REQUEST.match(rest)
        if request is None:
            self._control_line(rest, _epoch(match["ts"]))
            return None
        return self._request(request, _epoch(match["ts"]))

    def _control_line(self, rest: str, stamp: float) -> None:
        if rest.endswith("new request"):
            new = _NEW.match(rest)
            if new:
                self._last_attempt.pop(new["span"], None)
                self.open_spans[new["span"]] = stamp
        elif "meta request" in rest:
            meta = _META.match(rest)
            if meta:
                self.open_spans.pop(meta["span"], None)
                last = self._last_attempt.pop(meta["span"], None)
                if meta["end"] == "failed" and last and last.outcome == "failed" and last.retryable:
                    last.retried = False  # the final attempt: given up, not retried

    def _request(self, request: re.Match, end_wall_s: float) -> Request | Unparsed:
        fields, span = request["fields"], request["span"]
        kind_match = _TYPE.search(fields)
        opened = self.open_spans.get(span)
        if kind_match is None:
            return Unparsed(end_wall_s, "request_type", opened)
        kind = request_kind(kind_match[1], span)
        status, missing = _status(fields, request["outcome"])
        duration = _DURATION.search(fields)
        duration_s = _seconds(duration[1]) if duration else None
        ttfb = _TTFB.search(fields)
        ttfb_s = _seconds(ttfb[1][5:-1]) if ttfb and ttfb[1].startswith("Some(") else None
        nbytes, range_missing = _nbytes(fields, kind, request["outcome"])
        missing = (missing or ("duration" if duration_s is None else None)
                   or ("ttfb" if ttfb is None or (ttfb_s is None and ttfb[1] != "None") else None)
                   or range_missing)
        if missing:
            return Unparsed(end_wall_s, missing, opened)
        broken = request["outcome"] == "finished" and _CRT_ERROR.search(fields) is not None
        outcome = classify(kind, request["outcome"], status, broken)
        key = _KEY.search(span)
        retryable = outcome == "failed" and (broken or status is None or status >= 500
                                             or status in (408, 429))
        # retried: until its meta request turns out to have failed on it
        item = Request(end_wall_s=end_wall_s, kind=kind, outcome=outcome, status=status,
                       duration_s=duration_s, ttfb_s=ttfb_s, nbytes=nbytes,
                       key=key[1] if key else None, opened_wall_s=opened, broken=broken,
                       retryable=retryable, retried=retryable)
        self._last_attempt[span] = item
        return item

