"""A fault-injecting HTTP proxy for S3 on loopback: 503 SlowDown, connection resets,
latency, stalls, and wrong-region redirects, with counters of what it injected.

Put it between a client and an S3 server (SeaweedFS in the tests) and point the
client's endpoint at `proxy.url`::

    with FaultProxy("http://127.0.0.1:8333", error_503_rate=0.1, reset_rate=0.02,
                    seed=1) as proxy:
        run(f"dcp-fsdp save-and-load storage.endpoint={proxy.url} ...")
        proxy.counts["503"]["UploadPart"]    # how many UploadParts it answered 503
        proxy.injected()                     # {"503": n, "reset": n, ...}

or, for people, ``python -m dcp_fsdp.fault_proxy --upstream http://127.0.0.1:8333
--error-rate 0.1 --reset-rate 0.02`` (prints its URL; Ctrl-C prints the counters).

What it does to a request it targets (see `targets`), decided per request:

* ``503``: answers ``503 Slow Down`` with S3's XML ``<Error><Code>SlowDown</Code>...``
  body, without forwarding (the server never sees the request). A request body is
  read first (after ``100 Continue`` if the client asked), so the connection stays
  usable, as with S3.
* ``500``: the same with ``500 Internal Server Error`` and ``InternalError``: a server that
  cannot store or serve (S3's own failures; SeaweedFS with its volumes full).
* ``reset``: the TCP connection is reset (SO_LINGER 0, then close: an RST). A request
  with a body is cut mid-body (half of it read, never forwarded); a GET is forwarded
  and its response cut mid-body (head and half the body sent); anything else is reset
  before it is forwarded. No request reaches the server half-done, so a retry never
  meets a side effect of the failed attempt.
* ``stall``: holds the request (nothing read past its head, nothing answered) for
  ``stall_s`` seconds, then forwards it: a server that does not answer. With a long
  ``stall_s`` this is a hang; with a short one, a slow response.
* ``latency``: every targeted request waits ``latency_s`` before it is forwarded.
* ``max_resets``: at most this many resets in all (later draws of ``reset`` forward the
  request untouched), so a test can cut exactly two GETs. ``reset_after_bytes``: a GET is
  cut after this many body bytes instead of half its body.
* ``rate_bytes_per_s``: every body (request bodies forwarded up, response bodies relayed
  down) is paced to this many bytes per second, for the whole proxy together: a slow link.
  Its client sockets then take at most ``RATE_RCVBUF`` bytes a connection ahead of the
  pacing (SO_RCVBUF), so a client's TCP acknowledgements follow the link, as they would
  behind a slow one, not the proxy's kernel buffers (megabytes on loopback).
* ``hold_down_at_bytes``: once this many response body bytes went down (``bytes_down``,
  every request type), every response body waits until ``release_stalls()``: a load frozen
  at a known point. May be set while the proxy runs.
* ``redirect`` (``bucket_region=``): any request signed for a region other than
  ``bucket_region`` (the region in the SigV4 credential scope) is answered like AWS
  answers a request to a bucket in another region: ``301 Moved Permanently`` with
  ``x-amz-bucket-region`` and a ``PermanentRedirect`` error body (HEAD: no body).
  This applies to every request, targeted or not.

Requests are forwarded byte for byte: the head (request line, Host and every header,
in order) and the body as received, so SigV4 signatures stay valid. HTTP/1.1
keep-alive is kept (one upstream connection per client connection), bodies may be
Content-Length or chunked, ``Expect: 100-continue`` is relayed (the server's
``100 Continue`` goes back to the client; if the server answers nothing within 1 s
the body is sent anyway, as curl does), and each connection has its own thread.

Request types (``request_type``) come from the method, the query and a few headers,
S3's names: UploadPart (PUT with partNumber), CreateMultipartUpload (POST ?uploads),
CompleteMultipartUpload (POST ?uploadId), AbortMultipartUpload, PutObject, CopyObject,
GetObject, GetObjectRanged (GET with a Range header), HeadObject, HeadBucket,
ListObjectsV2, DeleteObject, DeleteObjects, ... Path-style addressing is assumed
(``/bucket/key``), which is what clients use with a custom endpoint here.

Targets: by default only the data plane, ``DATA_PLANE`` = UploadPart and
GetObjectRanged, the requests that move checkpoint bytes through the connector's CRT
client (which retries them ``max_attempts`` times). dcp-fsdp's control-plane calls
(boto3: HeadBucket, ListObjectsV2, small PutObject/GetObject, 2 attempts) are left
alone, so a test fails only where it means to. ``targets=None`` (CLI: ``--targets
all``) faults every request. ``key_pattern`` (CLI: ``--key-pattern``), a regular
expression searched in the request's ``/bucket/key`` path, narrows the targets to some
objects, e.g. one rank's data file or DCP's ``.metadata``.

Randomness is seeded and drawn per request type: the n-th request of a type gets the
same decision in every run with the same seed, however requests of different types
interleave across threads. Counters: ``counts[kind][request_type]`` for kind in
``requests`` (every request seen), ``expect_continue`` (requests that sent ``Expect:
100-continue``), ``503``, ``reset``, ``stall``, ``latency``, ``redirect``; ``events``
lists each injected fault with its monotonic time; ``connections`` counts the client
connections accepted. What went through the wire, body bytes only (no heads):
``counts["bytes_down"][request_type]`` relayed to the client (a cut GET: what reached the
client's kernel before the reset: the proxy waits up to CUT_DRAIN_S for what it sent to
leave, and uncounts what had not, which the reset discards),
``counts["bytes_up"][request_type]`` forwarded to the server,
``counts["bytes_cut"][request_type]`` the part of bytes_down that went out in responses
the proxy then cut (the body a client got in part and must fetch again); with
``record_bytes()``, ``byte_log`` keeps (time.monotonic(), cumulative bytes_down,
cumulative bytes_up) after each piece, so a test can ask what had passed by a moment.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import json
import random
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
import uuid
from typing import Any, Iterable

DATA_PLANE = ("UploadPart", "GetObjectRanged")
FAULT_KINDS = ("503", "500", "reset", "stall", "latency", "redirect")
# The error answers a fault sends: status line, S3's error code and message
_ERROR_ANSWERS = {
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": ("500 Internal Server Error", "InternalError",
            "We encountered an internal error. Please try again."),
}
SIOCOUTQNSD = 0x894B  # linux/sockios.h: a socket's bytes queued and not yet sent
CUT_DRAIN_S = 5.0  # how long a cut waits for its sent bytes to leave (the client is reading)
BYTE_KINDS = ("bytes_down", "bytes_up", "bytes_cut")  # body bytes relayed (counts), not faults
CONTINUE_WAIT_S = 1.0  # how long to wait for the server's 100 Continue before sending the body
_CHUNK = 256 * 1024
RATE_RCVBUF = 64 * 1024  # with rate_bytes_per_s: a client connection's receive buffer
_MAX_HEAD = 64 * 1024


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    """One fault the proxy injected."""

    mono_s: float  # time.monotonic() when it was injected
    kind: str  # one of FAULT_KINDS
    request_type: str
    method: str
    target: str  # request target (path and query)


@dataclasses.dataclass
class Exchange:
    """One request the proxy relayed, timed on the proxy's own wall clock."""

    request_type: str
    method: str
    target: str
    head_s: float  # time.time() when its head had been read
    end_s: float | None = None  # just before the last piece of its response was sent


class _Closed(Exception):
    """The peer closed the connection (or it was reset)."""


# -- HTTP/1.1 message parsing ------------------------------------------------------------

@dataclasses.dataclass
class _Message:
    head: bytes  # raw, up to and including the blank line
    start_line: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for t in (self.header(name) or "").split(",") if t.strip()}


def _read_head(reader) -> _Message | None:
    """One request or response head; None on a clean EOF before any byte."""
    lines: list[bytes] = []
    size = 0
    while True:
        line = reader.readline(_MAX_HEAD + 1)
        if not line:
            if lines:
                raise _Closed("connection closed inside a message head")
            return None
        if not lines and line in (b"\r\n", b"\n"):
            continue  # tolerated empty lines before a request (RFC 9112 2.2)
        lines.append(line)
        size += len(line)
        if size > _MAX_HEAD:
            raise _Closed("message head too large")
        if line in (b"\r\n", b"\n"):
            break
    text = [raw.decode("latin-1").rstrip("\r\n") for raw in lines[:-1]]
    headers = []
    for raw in text[1:]:
        if ":" in raw:
            key, value = raw.split(":", 1)
            headers.append((key.strip(), value.strip()))
    return _Message(b"".join(lines), text[0], headers)


def _body_framing(message: _Message) -> tuple[str, int]:
    """("none" | "length" | "chunked" | "eof", content length)."""
    if "chunked" in message.tokens("transfer-encoding"):
        return "chunked", 0
    length = message.header("content-length")
    if length is not None:
        return ("length", int(length)) if int(length) > 0 else ("none", 0)
    return "eof", 0


def _relay_body(reader, sink, framing: tuple[str, int], limit: int | None = None) -> bool:
    """Copy a body from `reader` to `sink(bytes)` (None: discard). With `limit`, stop after
    that many raw bytes and return False; True once the whole body went through."""
    kind, length = framing
    budget = [limit]

    def emit(data: bytes) -> bool:
        if budget[0] is not None:
            if len(data) >= budget[0]:
                if sink is not None and budget[0] > 0:
                    sink(data[:budget[0]])
                budget[0] = 0
                return False
            budget[0] -= len(data)
        if sink is not None:
            sink(data)
        return True

    if kind == "none":
        return True
    if kind == "length":
        remaining = length
        while remaining > 0:
            data = reader.read1(min(_CHUNK, remaining))
            if not data:
                raise _Closed("connection closed inside a body")
            remaining -= len(data)
            if not emit(data):
                return False
        return True
    if kind == "chunked":
        while True:
            size_line = reader.readline(1024)
            if not size_line:
                raise _Closed("connection closed inside a chunked body")
            if not emit(size_line):
                return False
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = reader.readline(_MAX_HEAD)
                    if not trailer:
                        raise _Closed("connection closed inside chunked trailers")
                    if not emit(trailer):
                        return False
                    if trailer in (b"\r\n", b"\n"):
                        return True
            remaining = size + 2  # data and its CRLF
            while remaining > 0:
                data = reader.read1(min(_CHUNK, remaining))
                if not data:
                    raise _Closed("connection closed inside a chunk")
                remaining -= len(data)
                if not emit(data):
                    return False
    # "eof": until the sender closes
    while True:
        data = reader.read1(_CHUNK)
        if not data:
            return True
        if not emit(data):
            return False


def _half(framing: tuple[str, int]) -> int:
    """How many raw body bytes to let through before a reset."""
    kind, length = framing
    return max(1, length // 2) if kind == "length" else 16 * 1024


# -- S3 request classification -------------------------------------------------------------

def request_type(method: str, target: str, headers: Iterable[tuple[str, str]] = ()) -> str:
    """S3's name for a request (path-style addressing: /bucket[/key])."""
    header = {k.lower(): v for k, v in headers}
    parsed = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    path = parsed.path.lstrip("/")
    has_key = "/" in path and path.split("/", 1)[1] != ""
    method = method.upper()
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if not has_key:
            if query.get("list-type") == ["2"]:
                return "ListObjectsV2"
            for name, kind in (("uploads", "ListMultipartUploads"), ("location", "GetBucketLocation"),
                               ("versions", "ListObjectVersions")):
                if name in query:
                    return kind
            return "ListObjects" if path else "ListBuckets"
        if "uploadId" in query:
            return "ListParts"
        return "GetObjectRanged" if "range" in header else "GetObject"
    if method == "PUT":
        if not has_key:
            return "CreateBucket" if not query else "PutBucketConfiguration"
        if "partNumber" in query:
            return "UploadPartCopy" if "x-amz-copy-source" in header else "UploadPart"
        return "CopyObject" if "x-amz-copy-source" in header else "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        if "delete" in query:
            return "DeleteObjects"
        return "PostObject"
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload"
        return "DeleteObject" if has_key else "DeleteBucket"
    return method.title()


_CREDENTIAL = re.compile(r"Credential=([^,\s]+)")


def signed_region(method_target: str, headers: Iterable[tuple[str, str]]) -> str | None:
    """The region a SigV4 request was signed for (credential scope), or None if unsigned."""
    for key, value in headers:
        if key.lower() == "authorization":
            match = _CREDENTIAL.search(value)
            if match:
                scope = match.group(1).split("/")
                return scope[2] if len(scope) >= 5 else None
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(method_target).query)
    credential = query.get("X-Amz-Credential")
    if credential:
        scope = credential[0].split("/")
        return scope[2] if len(scope) >= 5 else None
    return None


def _error_response(status: str, code: str, message: str, resource: str, head_only: bool,
                    extra_headers: Iterable[tuple[str, str]] = (), extra_xml: str = "",
                    keep_alive: bool = True) -> bytes:
    request_id = uuid.uuid4().hex[:16].upper()
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message>{extra_xml}<Resource>{_xml(resource)}</Resource>"
            f"<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>").encode()
    lines = [f"HTTP/1.1 {status}", "Content-Type: application/xml",
             f"Content-Length: {0 if head_only else len(body)}", f"x-amz-request-id: {request_id}",
             "Server: dcp-fsdp-fault-proxy",
             f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}",
             *(f"{k}: {v}" for k, v in extra_headers)]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _unsent(sock: socket.socket) -> int:
    """Bytes in the socket's send queue not yet sent (SIOCOUTQNSD; 0 where unknown)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock, SIOCOUTQNSD, b"\0" * 4))[0]
    except OSError:
        return 0


def _reset(sock: socket.socket, *files) -> None:
    """Close with an RST instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock, *files)


def _close(sock: socket.socket | None, *files) -> None:
    for f in files:
        try:
            f.close()
        except OSError:
            pass
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


# -- the proxy -----------------------------------------------------------------------------

class FaultProxy:
    """A fault-injecting HTTP/1.1 proxy on `host` in front of `upstream` (http://host:port).

    Rates are probabilities per targeted request (503, 500, reset and stall exclusive, drawn
    in that order; their sum must be at most 1). Use as a context manager, or call
    start() / stop(). Thread-safe; settings may be changed while it runs (e.g.
    ``proxy.error_503_rate = 1.0``)."""

    def __init__(self, upstream: str, *, error_503_rate: float = 0.0, error_500_rate: float = 0.0,
                 reset_rate: float = 0.0,
                 latency_s: float = 0.0, stall_rate: float = 0.0, stall_s: float = 30.0,
                 seed: int = 0, targets: Iterable[str] | None = DATA_PLANE,
                 key_pattern: str | None = None, bucket_region: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_resets: int | None = None,
                 reset_after_bytes: int | None = None,
                 rate_bytes_per_s: float | None = None,
                 hold_down_at_bytes: int | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream={upstream!r}: expected http://HOST:PORT (no TLS)")
        self.upstream = (parsed.hostname, parsed.port)
        self.error_503_rate = error_503_rate
        self.error_500_rate = error_500_rate
        self.reset_rate = reset_rate
        self.latency_s = latency_s
        self.stall_rate = stall_rate
        self.stall_s = stall_s
        self.seed = seed
        self.targets = None if targets is None else frozenset(targets)
        # Only requests whose path (/bucket/key, unquoted, no query) matches are targeted,
        # e.g. r"__1_\d+\.distcp$" (rank 1's data file) or r"/\.metadata$" (DCP's commit).
        self.key_pattern = None if key_pattern is None else re.compile(key_pattern)
        self.bucket_region = bucket_region
        self.host, self.port = host, port
        self.max_resets = max_resets
        self.reset_after_bytes = reset_after_bytes
        self.rate_bytes_per_s = rate_bytes_per_s
        self.hold_down_at_bytes = hold_down_at_bytes
        self._paced_until = 0.0  # monotonic time the link is busy until (rate_bytes_per_s)
        self._reserved_resets = 0  # resets decided so far (max_resets)
        self._totals = [0, 0]  # body bytes down, up (byte_log's running sums)
        # With record_bytes(): (monotonic time, bytes_down so far, bytes_up so far) per piece
        self.byte_log: list[tuple[float, int, int]] | None = None
        if error_503_rate + error_500_rate + reset_rate + stall_rate > 1.0 + 1e-9:
            raise ValueError("error_503_rate + error_500_rate + reset_rate + stall_rate must be "
                             "at most 1")
        self._lock = threading.Lock()
        self._rngs: dict[str, random.Random] = {}
        self._counts: dict[str, collections.Counter] = {
            kind: collections.Counter() for kind in ("requests", "expect_continue", *FAULT_KINDS,
                                                      *BYTE_KINDS)}
        self.connections = 0  # client connections accepted (keep-alive reuses one)
        self.events: list[FaultEvent] = []
        # With record_timeline(): every exchange as an Exchange (wall clock), an outside
        # clock for the tool's timer (benchmarks/outside_clock.py).
        self.timeline: list[Exchange] | None = None
        self._local = threading.local()
        self._stopping = threading.Event()
        self._released = threading.Event()  # release_stalls(): held requests go on now
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()
        self._accept_thread: threading.Thread | None = None

    # -- public --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """{kind: {request type: n}} for kind in "requests" (every request seen),
        "expect_continue" (requests that sent Expect: 100-continue), each fault kind, and
        "bytes_down" / "bytes_up" (body bytes relayed each way)."""
        with self._lock:
            return {kind: dict(counter) for kind, counter in self._counts.items()}

    def injected(self) -> dict[str, int]:
        """Total faults injected per kind."""
        with self._lock:
            return {kind: sum(self._counts[kind].values()) for kind in FAULT_KINDS}

    def reset_counts(self) -> None:
        with self._lock:
            for counter in self._counts.values():
                counter.clear()
            self._totals = [0, 0]
            self.events.clear()
            self.connections = 0

    def record_bytes(self) -> "FaultProxy":
        """From now on, keep the running byte totals after every relayed piece in `byte_log`."""
        with self._lock:
            self.byte_log = []
        return self

    def bytes_by(self, mono_s: float) -> tuple[int, int]:
        """(bytes_down, bytes_up) that had passed by time.monotonic() `mono_s` (record_bytes)."""
        with self._lock:
            passed = (0, 0)
            for at, down, up in self.byte_log or ():
                if at > mono_s:
                    break
                passed = (down, up)
            return passed

    def _pace_and_count(self, kind: str, rtype: str, nbytes: int) -> None:
        """Count `nbytes` of body relayed; with rate_bytes_per_s, first wait until the link
        (one for both directions, the whole proxy) has room for them."""
        while (kind == "bytes_down" and self.hold_down_at_bytes is not None
               and self._totals[0] + nbytes > self.hold_down_at_bytes
               and not self._released.is_set()):
            if self._stopping.wait(0.05):
                return
        if self.rate_bytes_per_s:
            with self._lock:
                start = max(time.monotonic(), self._paced_until)
                self._paced_until = start + nbytes / self.rate_bytes_per_s
                wait_s = self._paced_until - time.monotonic()
            if wait_s > 0:
                self._stopping.wait(wait_s)
        self._count_bytes(kind, rtype, nbytes)

    def _count_bytes(self, kind: str, rtype: str, nbytes: int) -> None:
        with self._lock:
            self._counts[kind][rtype] += nbytes
            if kind == "bytes_cut":
                return  # already in bytes_down
            self._totals[0 if kind == "bytes_down" else 1] += nbytes
            if self.byte_log is not None:
                self.byte_log.append((time.monotonic(), self._totals[0], self._totals[1]))

    def record_timeline(self) -> "FaultProxy":
        """From now on, keep every exchange with its proxy-side times in `timeline`."""
        self.timeline = []
        return self

    def wait_for_injection(self, process: Any, timeout_s: float) -> bool:
        """Wait until the proxy injected a fault, `process` (a Popen) ended, or `timeout_s`
        passed; whether a fault was injected."""
        deadline = time.monotonic() + timeout_s
        while not self.events and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.events)

    def release_stalls(self) -> None:
        """Forward every held request now, and hold no more (stall_s cut short)."""
        self._released.set()

    def start(self) -> "FaultProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.rate_bytes_per_s:  # set before accepting: accepted sockets inherit it
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RATE_RCVBUF)
        listener.bind((self.host, self.port))
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"fault-proxy-{self.port}")
        self._accept_thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (stalls included) and join the threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)
        if self._listener is not None:
            _close(self._listener)
            self._listener = None
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- decisions -----------------------------------------------------------------------
    def _targeted(self, rtype: str, target: str) -> bool:
        if self.targets is not None and rtype not in self.targets:
            return False
        if self.key_pattern is not None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
            return self.key_pattern.search(path) is not None
        return True

    def _decide(self, rtype: str, target: str) -> str | None:
        if not self._targeted(rtype, target):
            return None
        with self._lock:
            rng = self._rngs.get(rtype)
            if rng is None:
                rng = self._rngs[rtype] = random.Random(f"{self.seed}:{rtype}")
            draw = rng.random()
        for kind, rate in (("503", self.error_503_rate), ("500", self.error_500_rate),
                           ("reset", self.reset_rate), ("stall", self.stall_rate)):
            if draw < rate:
                if kind == "reset" and self.max_resets is not None:
                    with self._lock:  # taken now: two GETs drawn at once cannot both pass
                        if self._resets_left() <= 0:
                            return None
                        self._reserved_resets += 1
                return kind
            draw -= rate
        return None

    def _resets_left(self) -> int:
        assert self.max_resets is not None
        return self.max_resets - self._reserved_resets

    def _count(self, kind: str, rtype: str, method: str = "", target: str = "") -> None:
        with self._lock:
            self._counts[kind][rtype] += 1
            if kind in FAULT_KINDS:
                self.events.append(FaultEvent(time.monotonic(), kind, rtype, method, target))

    # -- connections -----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                assert self._listener is not None
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            with self._lock:
                self._sockets.add(client)
                self._threads.add(thread)
                self.connections += 1
            thread.start()

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._sockets.add if add else self._sockets.discard)(sock)

    def _serve(self, client: socket.socket) -> None:
        reader = client.makefile("rb", buffering=_CHUNK)
        upstream: list = [None, None]  # socket, reader
        try:
            while not self._stopping.is_set():
                try:
                    keep = self._one_exchange(client, reader, upstream)
                finally:
                    self._close_exchange()
                if not keep:
                    break
        except (_Closed, OSError, ValueError):
            pass
        finally:
            if upstream[0] is not None:
                self._track(upstream[0], False)
                _close(upstream[0], upstream[1])
            self._track(client, False)
            _close(client, reader)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _open_exchange(self, exchange: Exchange) -> None:
        if self.timeline is not None:
            self._local.exchange = exchange
            with self._lock:
                self.timeline.append(exchange)

    def _stamp_end(self) -> None:
        exchange = getattr(self._local, "exchange", None)
        if exchange is not None:
            exchange.end_s = time.time()

    def _close_exchange(self) -> None:
        """An exchange that ended without a response relayed (a fault) ends now."""
        exchange = getattr(self._local, "exchange", None)
        if exchange is not None:
            if exchange.end_s is None:
                exchange.end_s = time.time()
            self._local.exchange = None

    def _upstream(self, upstream: list):
        if upstream[0] is None:
            sock = socket.create_connection(self.upstream, timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._track(sock, True)
            upstream[0], upstream[1] = sock, sock.makefile("rb", buffering=_CHUNK)
        return upstream[0], upstream[1]

    def _drop_upstream(self, upstream: list) -> None:
        if upstream[0] is not None:
            self._track(upstream[0], False)
            _close(upstream[0], upstream[1])
        upstream[0] = upstream[1] = None

    def _one_exchange(self, client: socket.socket, reader, upstream: list) -> bool:
        """Serve one request; True to keep the client connection for another."""
        request = _read_head(reader)
        if request is None:
            return False
        parts = request.start_line.split(" ")
        if len(parts) != 3:
            client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n"
                           b"Connection: close\r\n\r\n")
            return False
        method, target, version = parts
        rtype = request_type(method, target, request.headers)
        self._count("requests", rtype)
        self._open_exchange(Exchange(rtype, method, target, time.time()))
        framing = _body_framing(request)
        if framing[0] == "eof":  # a request without length has no body (RFC 9112 6.3)
            framing = ("none", 0)
        expects_continue = "100-continue" in request.tokens("expect")
        if expects_continue:
            self._count("expect_continue", rtype)
        client_close = ("close" in request.tokens("connection")
                        or (version == "HTTP/1.0" and "keep-alive" not in request.tokens("connection")))
        head_only = method.upper() == "HEAD"

        def consume_body() -> None:
            if framing[0] == "none":
                return
            if expects_continue:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            _relay_body(reader, None, framing)

        if self.bucket_region is not None:
            region = signed_region(target, request.headers)
            if region is not None and region != self.bucket_region:
                self._count("redirect", rtype, method, target)
                consume_body()
                bucket = urllib.parse.urlsplit(target).path.lstrip("/").split("/", 1)[0]
                client.sendall(_error_response(
                    "301 Moved Permanently", "PermanentRedirect",
                    "The bucket you are attempting to access must be addressed using the "
                    "specified endpoint. Please send all future requests to this endpoint.",
                    urllib.parse.urlsplit(target).path, head_only,
                    extra_headers=[("x-amz-bucket-region", self.bucket_region)],
                    extra_xml=(f"<Endpoint>{_xml(bucket)}.s3.{self.bucket_region}.amazonaws.com"
                               f"</Endpoint><Bucket>{_xml(bucket)}</Bucket>"),
                    keep_alive=not client_close))
                return not client_close

        fault = self._decide(rtype, target)
        if fault in _ERROR_ANSWERS:
            self._count(fault, rtype, method, target)
            consume_body()
            client.sendall(_error_response(*_ERROR_ANSWERS[fault], urllib.parse.urlsplit(target).path,
                                           head_only, keep_alive=not client_close))
            return not client_close
        if fault == "reset" and (framing[0] != "none" or method.upper() != "GET"):
            # Cut the request: mid-body if it has one, else before forwarding it.
            self._count("reset", rtype, method, target)
            if framing[0] != "none":
                if expects_continue:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                _relay_body(reader, None, framing, limit=_half(framing))
            self._track(client, False)
            _reset(client, reader)
            raise _Closed("reset injected")
        if fault == "stall":
            self._count("stall", rtype, method, target)
            deadline = time.monotonic() + self.stall_s
            while not self._released.is_set() and time.monotonic() < deadline:
                if self._stopping.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                    return False
        if self.latency_s > 0 and self._targeted(rtype, target):
            self._count("latency", rtype, method, target)
            if self._stopping.wait(self.latency_s):
                return False

        # Forward the request as received.
        try:
            up, up_reader = self._upstream(upstream)
            up.sendall(request.head)
        except OSError:
            # A kept-alive upstream connection the server closed meanwhile: one fresh try.
            self._drop_upstream(upstream)
            up, up_reader = self._upstream(upstream)
            up.sendall(request.head)
        response = None
        if framing[0] != "none":
            if expects_continue:
                # Nothing is buffered from this connection (no pipelining): select is exact.
                readable, _, _ = select.select([up], [], [], CONTINUE_WAIT_S)
                if readable:
                    response = _read_head(up_reader)
                    if response is None:
                        raise _Closed("server closed the connection")
                    if _status(response) == 100:
                        client.sendall(response.head)
                        response = None
                if response is not None:
                    # The server answered before the body (e.g. 403): relay that and close,
                    # since the client may or may not send the body now.
                    self._relay_response(client, up_reader, response, head_only, None, rtype)
                    return False
                elif not readable:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            def forward(data: bytes) -> None:
                self._pace_and_count("bytes_up", rtype, len(data))  # counted before it goes
                up.sendall(data)

            _relay_body(reader, forward, framing)
        while True:
            response = _read_head(up_reader)
            if response is None:
                raise _Closed("server closed the connection")
            if 100 <= _status(response) < 200:
                continue  # interim responses (a late 100 Continue): the client got its own
            break
        cut = fault == "reset"  # a GET: its response is cut mid-body
        if cut:
            self._count("reset", rtype, method, target)
        limit = None
        if cut:
            limit = (_half(_body_framing(response)) if self.reset_after_bytes is None
                     else self.reset_after_bytes)
        complete = self._relay_response(client, up_reader, response, head_only, limit, rtype)
        if cut:
            self._uncount_unsent(client, rtype)
        if not complete or cut:
            self._drop_upstream(upstream)
            self._track(client, False)
            _reset(client, reader)
            raise _Closed("reset injected")
        server_close = "close" in response.tokens("connection") or \
            _body_framing(response)[0] == "eof" and not head_only and \
            _status(response) not in (204, 304)
        if server_close:
            self._drop_upstream(upstream)
        return not (client_close or server_close)

    def _uncount_unsent(self, client: socket.socket, rtype: str) -> None:
        """Before a cut: let the bytes handed to the kernel reach the client (it is reading
        the body), up to a few seconds; what is still unsent then is discarded by the reset
        and never passed down, so it leaves bytes_down and bytes_cut. The counts are then
        what reached the client's kernel, the figure a load's egress is held to."""
        deadline = time.monotonic() + CUT_DRAIN_S
        while (unsent := _unsent(client)) and time.monotonic() < deadline:
            time.sleep(0.001)
        if unsent:
            self._count_bytes("bytes_down", rtype, -unsent)
            self._count_bytes("bytes_cut", rtype, -unsent)

    def _relay_response(self, client, up_reader, response: _Message, head_only: bool,
                        limit: int | None, rtype: str) -> bool:
        def send(data: bytes) -> None:
            # stamped before each piece goes out: after the last, the exchange's end is
            # no later than the client's receipt of its last byte
            self._stamp_end()
            client.sendall(data)

        def send_body(data: bytes) -> None:
            # counted before it goes: bytes_down is never less than what the client has
            self._pace_and_count("bytes_down", rtype, len(data))
            if limit is not None:
                self._count_bytes("bytes_cut", rtype, len(data))
            send(data)

        send(response.head)
        status = _status(response)
        if head_only or status in (204, 304):
            return True
        return _relay_body(up_reader, send_body, _body_framing(response), limit)


def _status(response: _Message) -> int:
    try:
        return int(response.start_line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise _Closed(f"bad status line {response.start_line!r}") from None


# -- command line ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dcp_fsdp.fault_proxy",
        description="Fault-injecting HTTP proxy in front of an S3 server (loopback testing). "
                    "Point the client's endpoint at the URL it prints; Ctrl-C prints what it "
                    "injected as JSON.")
    parser.add_argument("--upstream", required=True, help="the S3 server, http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    parser.add_argument("--error-rate", type=float, default=0.0,
                        help="fraction of targeted requests answered 503 SlowDown")
    parser.add_argument("--reset-rate", type=float, default=0.0,
                        help="fraction of targeted requests whose connection is reset mid-body")
    parser.add_argument("--stall-rate", type=float, default=0.0,
                        help="fraction of targeted requests held unanswered for --stall-s")
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument("--latency-s", type=float, default=0.0,
                        help="delay added to every targeted request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(DATA_PLANE),
                        help="request types to fault, comma-separated, or 'all' "
                             f"(default: {','.join(DATA_PLANE)})")
    parser.add_argument("--key-pattern", default=None,
                        help="fault only requests whose /bucket/key path matches this regex")
    parser.add_argument("--bucket-region", default=None,
                        help="answer requests signed for any other region with 301 "
                             "PermanentRedirect + x-amz-bucket-region")
    args = parser.parse_args(argv)
    targets = None if args.targets == "all" else [t for t in args.targets.split(",") if t]
    try:
        proxy = FaultProxy(args.upstream, error_503_rate=args.error_rate,
                           reset_rate=args.reset_rate, latency_s=args.latency_s,
                           stall_rate=args.stall_rate, stall_s=args.stall_s, seed=args.seed,
                           targets=targets, key_pattern=args.key_pattern,
                           bucket_region=args.bucket_region, host=args.host,
                           port=args.port)
    except ValueError as error:
        parser.error(str(error))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with proxy:
        print(f"fault proxy: {proxy.url} -> http://{proxy.upstream[0]}:{proxy.upstream[1]} "
              f"(targets: {args.targets})", flush=True)
        try:
            while not done.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    print(json.dumps({"injected": proxy.injected(), "counts": proxy.counts}, indent=2,
                     sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
