"""Bytes this process has really moved to and from storage, read from the kernel's TCP
counters of its sockets to the storage endpoint: what the progress heartbeat reports
(process/progress.py).

Why the kernel: the S3 clients say nothing while bytes move. The connector's writer takes
a whole checkpoint into its buffers long before the upload ends (a save at a 200 Mbit/s
link read 47 MiB/s and "631.4 of 631.3 MiB" 26 s before it ended), and its reader hands
out a part only once all of it has arrived (a load moving 22 MiB/s read 0.0 MiB/s). The
kernel counts, per TCP connection (`TCP_INFO`, Linux 4.1+), `tcpi_bytes_acked` (bytes the
peer acknowledged: a save's bytes that reached the storage's host) and
`tcpi_bytes_received` (a load's bytes as they arrive), HTTP heads included (a few hundred
bytes a request). No client needs to cooperate: s3torchconnector's CRT, s3fs and
multi-storage-client alike.

Which sockets: every TCP socket of this process whose peer port is the endpoint's (443 or
80 without an endpoint: the collectives' own sockets use other ports). A socket is read
through a duplicate of its descriptor (found in /proc/self/fd), never touched otherwise. A
connection that closes between two readings keeps what it had at the last one: the figure
never goes back, and at most one interval of a closed connection's bytes goes uncounted.
Where /proc/self/fd or TCP_INFO cannot be read, `available()` is False and the heartbeat
says what it measures instead.
"""

from __future__ import annotations

import os
import socket
import struct
import urllib.parse
from typing import Callable

_ACKED_AT = 120  # offsetof(struct tcp_info, tcpi_bytes_acked); tcpi_bytes_received follows
_INFO_LEN = 136


def endpoint_port(endpoint: str | None) -> int:
    """The storage endpoint's TCP port (AWS's HTTPS without an endpoint)."""
    if not endpoint:
        return 443
    parsed = urllib.parse.urlsplit(endpoint)
    if parsed.port:
        return parsed.port
    return 80 if parsed.scheme == "http" else 443


def _socket_counts(port: int) -> dict[str, tuple[int, int]]:
    """{socket inode: (bytes acked, bytes received)} of this process's TCP sockets whose
    peer port is `port`."""
    found: dict[str, tuple[int, int]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if not target.startswith("socket:"):
            continue
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                # a duplicate: the client's own descriptor is never read from or closed
                with socket.fromfd(int(name), family, socket.SOCK_STREAM) as dup:
                    peer = dup.getpeername()  # a Unix socket's is a str (s3fs's aiohttp has one)
                    if not isinstance(peer, tuple) or peer[1] != port:
                        break
                    info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
            except OSError:
                continue  # not that family, not TCP, not connected, or closed meanwhile
            if len(info) >= _ACKED_AT + 16:
                found[target] = struct.unpack_from("QQ", info, _ACKED_AT)
            break
    return found


class WireMeter:
    """Bytes acknowledged by / received from the storage endpoint since `start()`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._baseline: dict[str, tuple[int, int]] = {}
        self._moved: dict[str, tuple[int, int]] = {}  # inode -> (acked, received) since start

    def available(self) -> bool:
        try:
            _socket_counts(self.port)
        except OSError:
            return False
        return hasattr(socket, "TCP_INFO")

    def start(self) -> None:
        """Connections open now (kept alive from an earlier operation) count from here."""
        self._baseline = _socket_counts(self.port)
        self._moved = {}

    def _read(self) -> tuple[int, int]:
        for inode, (acked, received) in _socket_counts(self.port).items():
            base_acked, base_received = self._baseline.get(inode, (0, 0))
            if acked < base_acked or received < base_received:
                # the inode of a closed connection, now another's: the old one keeps its bytes
                self._moved[f"{inode}/{len(self._moved)}"] = self._moved.pop(inode, (0, 0))
                self._baseline[inode] = base_acked, base_received = (0, 0)
            self._moved[inode] = (acked - base_acked, received - base_received)
        return (sum(a for a, _ in self._moved.values()),
                sum(r for _, r in self._moved.values()))

    def acked(self) -> int:
        """Bytes the endpoint acknowledged (a save's uploaded bytes, heads included)."""
        return self._read()[0]

    def received(self) -> int:
        """Bytes received from the endpoint (a load's downloaded bytes, heads included)."""
        return self._read()[1]


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
            return meter.received, "received", "from the storage endpoint, as it arrives", \
                meter.start
    # no TCP counters (fs, or a kernel without them): what DCP handed to / took from the
    # streams, said so (a client's buffers run ahead of its upload)
    if save:
        return streams, "handed", "to the writer's streams, not yet stored", None
    return streams, "read", "out of the reader's streams", None
