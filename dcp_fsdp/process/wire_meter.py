"""Bytes this process has really moved to and from storage, from the kernel's TCP counters of
its sockets to the storage endpoint: what the progress heartbeat reports (process/progress.py),
and a load's egress in the record (rank/sample_build.py; docs/metrics.md, "egress MiB").

Why the kernel: the S3 clients say nothing while bytes move. The connector's writer takes a
whole checkpoint into its buffers long before the upload ends (a save at a 200 Mbit/s link read
47 MiB/s and "631.4 of 631.3 MiB" 26 s before it ended), its reader hands out a part only once
all of it has arrived (a load moving 22 MiB/s read 0.0 MiB/s), and a GET cut mid-body drops the
socket's unread bytes, so no client can say what came down. The kernel counts, per TCP
connection (`TCP_INFO`, Linux 4.1+), `tcpi_bytes_acked` (a save's bytes that reached the
storage's host) and `tcpi_bytes_received` (a load's, as they arrive), HTTP heads included,
whatever the client.

Which sockets: every TCP socket of this process whose peer port is the endpoint's (the
collectives use other ports), found in /proc/self/fd and known by its cookie (SO_COOKIE, unique
while the host runs); a closed one's last counters come from the destroy broadcast
(`_ClosedSockets`). One opened and closed between two scans is never seen to be this process's,
so `watch()` scans while an operation runs, and the botocore clients' GET hooks name each GET's
socket (`note_socket`): the connector's CRT connections count once a scan has seen them. Where
/proc/self/fd or TCP_INFO cannot be read, `available()` is False; without the broadcast (`exact`
False) a closed connection keeps what it had at the last scan.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import stat
import struct
import threading
import time
import urllib.parse
import weakref
from typing import Callable

_ACKED_AT = 120  # offsetof(struct tcp_info, tcpi_bytes_acked); tcpi_bytes_received follows
_INFO_LEN = 136
_SO_COOKIE = 57  # asm-generic/socket.h (Linux 4.12+)
_SO_ATTACH_FILTER = 26
_NETLINK_SOCK_DIAG = 4
_DESTROY_GROUPS = 1 | 4  # SKNLGRP_INET_TCP_DESTROY (1), SKNLGRP_INET6_TCP_DESTROY (3): bits
_DIAG_MSG_LEN = 72  # struct inet_diag_msg; its cookie at 44, then rtattrs
_INET_DIAG_INFO = 2
_TCP_LISTEN = 10  # tcpi_state of a listening socket
_METERS: "weakref.WeakSet[WireMeter]" = weakref.WeakSet()  # started, for note_socket


def endpoint_port(endpoint: str | None) -> int:
    """The storage endpoint's TCP port (AWS's HTTPS without an endpoint)."""
    if not endpoint:
        return 443
    parsed = urllib.parse.urlsplit(endpoint)
    return parsed.port or (80 if parsed.scheme == "http" else 443)


def _inspect(fd: int, port: int) -> tuple[int, bool | None, tuple[int, int]] | None:
    """(cookie, to the endpoint: True / False / None if not connected now (reset, connecting),
    (acked, received)) of a TCP socket descriptor; None: not TCP, listening, or closed meanwhile."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            # a duplicate: the client's own descriptor is never read from or closed
            with socket.fromfd(fd, family, socket.SOCK_STREAM) as dup:
                info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
                cookie, = struct.unpack("Q", dup.getsockopt(socket.SOL_SOCKET, _SO_COOKIE, 8))
                if len(info) < _ACKED_AT + 16 or info[0] == _TCP_LISTEN:
                    return None
                counts = struct.unpack_from("QQ", info, _ACKED_AT)
                try:
                    peer = dup.getpeername()  # a Unix socket's is a str (s3fs's aiohttp has one)
                except OSError:
                    return cookie, None, counts
                return cookie, isinstance(peer, tuple) and peer[1] == port, counts
        except OSError:
            continue  # not that family, not TCP, or closed meanwhile
    return None


class _ClosedSockets:
    """The final counters of TCP sockets as the kernel frees them: sock_diag's destroy broadcast
    (SKNLGRP_INET{,6}_TCP_DESTROY, Linux 4.9+, any user), one message per freed socket with its
    cookie, ports and last tcp_info: a connection reset mid-body keeps what it had received until
    the client closes it, then only here. It covers the whole network namespace (other ranks, the
    server on loopback): a socket counts only where its cookie is this process's. A classic BPF
    filter passes only the endpoint's port, so a busy host does not fill the buffer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.lost = False  # the kernel dropped messages (buffer full): a figure may be short
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            # dport: a u16 at nlmsghdr (16) + family/state/timer/retrans (4) + sport (2)
            program = [(0x28, 0, 0, 22),           # ldh [22]
                       (0x15, 0, 1, port),         # jeq port ? next : drop
                       (0x06, 0, 0, 0xFFFFFFFF),   # ret all
                       (0x06, 0, 0, 0)]            # ret 0
            code = b"".join(struct.pack("HBBI", *op) for op in program)
            buffer = ctypes.create_string_buffer(code)
            fprog = struct.pack("HL", len(program), ctypes.addressof(buffer))
            self.sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            self.sock.bind((0, _DESTROY_GROUPS))
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def drain(self) -> dict[int, tuple[int, int]]:
        """{cookie: (bytes acked, bytes received)} of the endpoint's sockets freed since the last drain."""
        found: dict[int, tuple[int, int]] = {}
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return found
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                self.lost = True
                continue
            found.update(_destroyed(data, self.port))


def _destroyed(data: bytes, port: int) -> dict[int, tuple[int, int]]:
    """{cookie: (acked, received)} of the sock_diag messages in one netlink datagram."""
    found: dict[int, tuple[int, int]] = {}
    offset = 0
    while offset + 16 + _DIAG_MSG_LEN <= len(data):
        length, = struct.unpack_from("I", data, offset)
        body = data[offset + 16: offset + length]
        offset += max(16, (length + 3) & ~3)
        if len(body) < _DIAG_MSG_LEN or struct.unpack_from(">H", body, 6)[0] != port:
            continue
        low, high = struct.unpack_from("II", body, 44)
        at = _DIAG_MSG_LEN
        while at + 4 <= len(body):
            size, kind = struct.unpack_from("HH", body, at)
            if size < 4:
                break
            if kind == _INET_DIAG_INFO and size - 4 >= _ACKED_AT + 16:
                found[low | high << 32] = struct.unpack_from("QQ", body, at + 4 + _ACKED_AT)
            at += (size + 3) & ~3
    return found


# How often a watching meter looks for new sockets; each wake-up takes the GIL from the load it
# measures. Where no hook names a GET's socket (the connector's CRT), every 5 ms: a retry
# connection, opened and cut within milliseconds, is seen while its descriptor is open (at 20 ms
# and 100 ms a load whose GETs were cut missed some: tests/integration/test_clients.py). With the
# GET hooks (s3fs, MSC: `note_socket`), every 100 ms: MSC's load took 1.029x as long scanned
# every 5 ms as unscanned. A sock_diag dump per scan took a sixth of the GIL but missed a retry
# connection reset before any dump saw it (a reset socket leaves the kernel's table at once; its
# descriptor stays open until the client closes it).
WATCH_PERIOD_S = 0.005
HOOKED_WATCH_PERIOD_S = 0.1
# Every fast period only while connections open (OPENING_WINDOW_S after the operation's start
# and each connect() in the namespace) and for RETRY_WINDOW_S after a socket to the endpoint
# closes (the client's retry follows its backoff); every slow period otherwise. Scanned fast
# throughout, a connector load took 1.021x as long as bare; as now, 1.007x [1.004, 1.010]. The
# cut-GET egress test missed a cut connection with narrower settings (docs/harness-cost.md,
# "The wire meter's watch, narrowed"). Missed: a connection living within one slow period.
SLOW_WATCH_PERIOD_S = 0.05
OPENING_WINDOW_S = 0.2
RETRY_WINDOW_S = 1.0
# `ActiveOpens` of the namespace's TCP counters moves with every connect() in it, so a scan lists
# this process's descriptors only when it moved (a ~10 us pread, where a listing costs ~1 us a
# descriptor: a rank at 1,000 ranks holds ~1,000 gloo sockets). Skipping while the count of open
# descriptors stood still missed a retry connection opened as a file closed: a load cut twice
# counted one cut GET's bytes short (CI).
SNMP_PATH = "/proc/self/net/snmp"


class WireMeter:
    """Bytes to and from the storage endpoint since `start()` on this process's sockets, closed ones too."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._lock = threading.RLock()  # acked() holds it across _update's
        self._inodes: dict[int, int | None] = {}  # socket inode -> cookie (None: not ours to count)
        self._opens_listed = -1  # ActiveOpens read before the last listing (-1: list every scan)
        self._snmp_fd = -1
        self._unsettled = False  # a socket was connecting at the last scan
        self._wake_fds: tuple[int, ...] = ()  # a watching thread's wake-up pipe
        self._fast_until_s = 0.0  # monotonic: the watch scans every fast period until then
        self._own: dict[int, list[int]] = {}  # cookie -> [base acked, base received, acked, received]
        self._maybe: dict[int, list[int]] = {}  # not connected when seen: ours if it closes to the port
        self._final: set[int] = set()
        self._closed: _ClosedSockets | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.unseen_bytes = 0  # received on endpoint sockets that closed, never seen here

    def available(self) -> bool:
        try:
            os.listdir("/proc/self/fd")
        except OSError:
            return False
        return hasattr(socket, "TCP_INFO")

    @property
    def exact(self) -> bool:
        """Closed connections count to their last byte (the broadcast heard, nothing of it lost)."""
        return self._closed is not None and not self._closed.lost

    def start(self) -> None:
        """Connections open now (kept alive from an earlier operation) count from here."""
        self.close()
        with self._lock:
            self._inodes, self._own, self._maybe, self._final = {}, {}, {}, set()
            self.unseen_bytes = 0
            self._stop = threading.Event()
            try:
                self._closed = _ClosedSockets(self.port)  # before the scan: no close missed
            except OSError:
                self._closed = None
            try:
                self._snmp_fd = os.open(SNMP_PATH, os.O_RDONLY)
            except OSError:
                self._snmp_fd = -1
            self._scan(baseline=True)
        _METERS.add(self)

    def watch(self, period_s: float | None = None) -> None:
        """Scan every `period_s` until `close()` (every SLOW_WATCH_PERIOD_S, if longer, while no
        connection opens or closes), so short connections are seen (a thread)."""
        fast_s = WATCH_PERIOD_S if period_s is None else period_s
        slow_s = max(fast_s, SLOW_WATCH_PERIOD_S)
        self._wake_fds = os.pipe()  # hurry() and close() wake the thread's wait
        self._fast_until_s = time.monotonic() + OPENING_WINDOW_S
        self._thread = threading.Thread(target=self._run_watch, args=(fast_s, slow_s),
                                        name="wire-meter", daemon=True)
        self._thread.start()

    def hurry(self) -> None:
        """The operation starts now: scan fast while its connections open."""
        if self._wake_fds:
            self._fast_until_s = time.monotonic() + OPENING_WINDOW_S
            os.write(self._wake_fds[1], b"h")

    def _run_watch(self, fast_s: float, slow_s: float) -> None:
        """The watching thread: one poller, reused (each wake-up takes the GIL from the load)."""
        wake_r = self._wake_fds[0]
        poller = select.poll()  # not select: a rank at 1,000+ ranks holds descriptors past 1,024
        poller.register(wake_r, select.POLLIN)
        closed_fd = -1 if self._closed is None else self._closed.sock.fileno()
        if closed_fd >= 0:
            poller.register(closed_fd, select.POLLIN)
        while not self._stop.is_set():
            fast = time.monotonic() < self._fast_until_s
            ready = {fd for fd, _ in poller.poll((fast_s if fast else slow_s) * 1000)}
            if self._stop.is_set():
                return
            if wake_r in ready:
                os.read(wake_r, 4096)
            closed, opened = self._watch_step(closed_fd in ready)
            self._fast_until_s = fast_until(self._fast_until_s, time.monotonic(), closed, opened)

    def _watch_step(self, closes_heard: bool) -> tuple[bool, bool]:
        """One watch scan: (a socket to the endpoint closed, this process's descriptors were
        listed); only new sockets are read, and the broadcast only when poll says it has news."""
        with self._lock:
            closed = closes_heard and self._take_closed()
            return closed, self._scan(refresh=False)

    def close(self) -> None:
        """Stop watching; what was counted stays readable."""
        self._stop.set()
        if self._wake_fds:
            os.write(self._wake_fds[1], b"x")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for fd in self._wake_fds:
            os.close(fd)
        self._wake_fds = ()
        _METERS.discard(self)
        with self._lock:
            if self._snmp_fd >= 0:
                os.close(self._snmp_fd)
                self._snmp_fd = -1
            if self._closed is not None:
                self._take_closed()
                self._closed.sock.close()
                self._closed = None

    def note(self, fd: int) -> None:
        """A socket this process uses to the endpoint (a GET's, named by its client's hook)."""
        inode = _socket_inode(fd)
        with self._lock:
            if self._inodes.get(inode) is not None:
                return  # a kept-alive socket seen before: counted by its cookie until it closes
            found = _inspect(fd, self.port)
            if found is None:
                return
            cookie, _, counts = found
            if cookie in self._maybe:
                self._own[cookie] = self._maybe.pop(cookie)
            self._own.setdefault(cookie, [0, 0, *counts])
            self._inodes[inode] = cookie

    def _nothing_opened(self) -> bool:
        """No connection opened in the namespace since the last listing, none of ours was connecting
        then, and the broadcast is heard (a closed socket's counters come from it): nothing new."""
        if self._unsettled or self._closed is None or self._opens_listed < 0:
            return False
        return _active_opens(self._snmp_fd) == self._opens_listed

    def _scan(self, baseline: bool = False, refresh: bool = True) -> bool:
        if not (baseline or refresh) and self._nothing_opened():
            return False
        self._opens_listed = _active_opens(self._snmp_fd)  # before the listing: later opens differ
        sockets = _sockets()
        self._unsettled = False
        self._inodes = {i: c for i, c in self._inodes.items() if i in sockets}
        for inode, fd in sockets.items():
            if inode in self._inodes:
                if self._inodes[inode] is None:
                    continue  # another port, or not TCP
                if not refresh and self._closed is not None:
                    continue  # ours: its counters are read when asked, or as it closes
            found = _inspect(fd, self.port)
            if found is None:
                self._inodes[inode] = None
                continue
            cookie, to_endpoint, counts = found
            self._count(cookie, to_endpoint, counts, baseline)
            self._inodes[inode] = cookie if to_endpoint is not False else None
            if to_endpoint is None:
                self._inodes.pop(inode)  # not connected now: looked at again next scan
                self._unsettled = True
        return True  # listed

    def _count(self, cookie: int, to_endpoint: bool | None, counts: tuple[int, int],
               baseline: bool) -> None:
        if cookie in self._final:
            return
        base = list(counts) if baseline else [0, 0]
        if cookie in self._own or to_endpoint:
            self._own.setdefault(cookie, base + list(counts))[2:] = counts
        elif to_endpoint is None:
            self._maybe.setdefault(cookie, base + list(counts))[2:] = counts

    def _take_closed(self) -> bool:
        if self._closed is None:
            return False
        closed = self._closed.drain()
        for cookie, counts in closed.items():
            entry = self._own.get(cookie) or self._maybe.pop(cookie, None)
            if entry is None:
                self.unseen_bytes += counts[1]
                continue
            self._own[cookie] = entry
            entry[2:] = counts
            self._final.add(cookie)
        return bool(closed)  # any to the endpoint

    def _update(self) -> None:
        """Every socket's counters now, closed ones' from the broadcast."""
        with self._lock:
            self._take_closed()
            self._scan()
            self._take_closed()  # closed during the scan

    def acked(self) -> int:
        """Bytes the endpoint acknowledged (a save's uploaded bytes, heads included)."""
        with self._lock:
            self._update()
            return sum(e[2] - e[0] for e in self._own.values())

    def received(self) -> int:
        """Bytes received from the endpoint (a load's downloaded bytes, heads included)."""
        with self._lock:
            self._update()
            return sum(e[3] - e[1] for e in self._own.values())


def fast_until(until_s: float, now_s: float, closed: bool, opened: bool) -> float:
    """Until when a watch scans fast, after a scan at `now_s` that heard a socket to the endpoint
    close (its client may retry on a new connection) or saw connections open."""
    window_s = RETRY_WINDOW_S if closed else OPENING_WINDOW_S if opened else 0.0
    return max(until_s, now_s + window_s)


def _socket_inode(fd: int) -> int:
    """The inode of descriptor `fd` if it is a socket (what /proc names `socket:[INODE]`), else 0
    (closed meanwhile: 0). One fstat: a readlink of /proc/self/fd/N costs several times more."""
    try:
        status = os.fstat(fd)
    except OSError:
        return 0
    return status.st_ino if stat.S_ISSOCK(status.st_mode) else 0


def _sockets() -> dict[int, int]:
    """{socket inode: fd} of this process's socket descriptors."""
    fds = map(int, os.listdir("/proc/self/fd"))
    return {inode: fd for fd in fds if (inode := _socket_inode(fd))}


def _active_opens(snmp_fd: int) -> int:
    """`ActiveOpens` of /proc/net/snmp's TCP counters through the open `snmp_fd` (the second
    `Tcp:` line holds the values; the sixth is it); -1: unreadable."""
    try:
        data = os.pread(snmp_fd, 16384, 0)
        values_at = data.index(b"\nTcp: ", data.index(b"\nTcp: ") + 1)
        return int(data[values_at:values_at + 200].split(None, 6)[5])
    except (OSError, ValueError, IndexError):
        return -1


def note_socket(fd: int) -> None:
    """Tell every running meter that descriptor `fd` is a socket of this process's to
    storage (a client's hook, while the socket is open): counted whatever its life."""
    for meter in list(_METERS):
        meter.note(fd)


def progress_measure(op: str, s3: bool, endpoint: str | None,
                     streams: Callable[[], int] | None
                     ) -> tuple[Callable[[], int] | None, str, str, Callable[[], None] | None]:
    """What rank 0's heartbeat counts for `op`: (bytes so far, verb, how measured, its
    start), as process/progress.Heartbeat takes them. `streams`: bytes through the timed
    object streams (None: they move in another process, nothing to count)."""
    if streams is None:
        return None, "moved", "", None
    save = op == "save"
    if s3:
        meter = WireMeter(endpoint_port(endpoint))
        if meter.available():
            if save:
                return meter.acked, "uploaded", "acknowledged by the storage endpoint", meter.start
            return meter.received, "received", "from the storage endpoint, as it arrives", meter.start
    # no TCP counters (fs, or a kernel without them): what DCP handed to / took from the
    # streams, said so (a client's buffers run ahead of its upload)
    if save:
        return streams, "handed", "to the writer's streams, not yet stored", None
    return streams, "read", "out of the reader's streams", None
