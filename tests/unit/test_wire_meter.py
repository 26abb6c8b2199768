"""process/wire_meter.py: a connection cut mid-body counts to its last byte on the wire,
after its client closed it (issue 47, item 6)."""

from __future__ import annotations

import fcntl
import resource
import socket
import struct
import time

import pytest

from dcp_fsdp.process.wire_meter import (OPENING_WINDOW_S, RETRY_WINDOW_S, WireMeter, fast_until,
                                         note_socket)

SIOCOUTQ = 0x5411
SENT = 3 * 2**20


def _cut_after(server: socket.socket, nbytes: int) -> None:
    """Send `nbytes`, wait until the client's kernel acknowledged all of them, then reset:
    the client's kernel received exactly `nbytes`."""
    server.sendall(b"x" * nbytes)
    deadline = time.monotonic() + 10
    while struct.unpack("i", fcntl.ioctl(server, SIOCOUTQ, b"\0" * 4))[0] and \
            time.monotonic() < deadline:
        time.sleep(0.001)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server.close()


def _client(listener: socket.socket) -> socket.socket:
    """A client whose kernel takes SENT bytes unread (its buffer set before it connects)."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * SENT)
    client.connect(listener.getsockname())
    return client


def _cut_connection(listener: socket.socket, meter: WireMeter, noted: bool,
                    scanned: bool) -> int:
    """One connection to `listener`: the client reads a few bytes, the server sends SENT
    and resets it, the client closes it; what the client read."""
    client = _client(listener)
    server, _ = listener.accept()
    if noted:
        note_socket(client.fileno())
    if scanned:
        meter.received()
    _cut_after(server, SENT)
    read = len(client.recv(1000))
    with pytest.raises(ConnectionResetError):
        while client.recv(1 << 20):
            pass
    client.close()
    return read


@pytest.mark.parametrize("seen_by", ("note", "scan"))
def test_a_reset_connection_counts_what_its_kernel_received_after_it_closed(seen_by):
    """The client read a few hundred bytes of the 3 MiB its kernel received before the reset
    (the rest dropped with it); once its socket is closed, the kernel's counters of it are
    gone from the socket: the meter has them from the destroy broadcast, all 3 MiB. Before:
    the figure kept what the last reading saw (nothing, or what had arrived by then)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        meter = WireMeter(listener.getsockname()[1])
        meter.start()
        try:
            assert meter.exact
            read = _cut_connection(listener, meter, seen_by == "note", seen_by == "scan")
            assert read < SENT
            deadline = time.monotonic() + 10
            while meter.received() < SENT and time.monotonic() < deadline:
                time.sleep(0.01)  # the broadcast is sent from a kernel work queue
            assert meter.received() == SENT
        finally:
            meter.close()


def _watched_cut(listener: socket.socket, meter: WireMeter) -> int:
    """A connection to `listener` that only the meter's watch sees, cut after SENT bytes and
    closed; what the meter counts it received (waiting up to 10 s for the broadcast)."""
    client = _client(listener)
    server, _ = listener.accept()
    deadline = time.monotonic() + 10
    while not meter._own and time.monotonic() < deadline:
        time.sleep(0.001)  # the watch has seen it
    _cut_after(server, SENT)
    client.close()
    deadline = time.monotonic() + 10
    while meter.received() < SENT and time.monotonic() < deadline:
        time.sleep(0.01)
    return meter.received()


def test_a_watched_meter_sees_a_connection_no_reading_saw():
    """`watch()` scans while an operation runs: a connection opened and cut between two
    of the caller's readings counts to its last byte."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        meter = WireMeter(listener.getsockname()[1])
        meter.start()
        meter.watch(0.001)
        try:
            assert _watched_cut(listener, meter) == SENT
        finally:
            meter.close()


def test_a_watch_scan_sees_a_connection_opened_as_a_file_closed():
    """A watch scan (the thread's, driven by hand here) finds a connection opened between two
    scans while a file closed: as many descriptors open as before, the same number reused.
    Before, a scan skipped while the count of descriptors stood still, and a load cut twice
    counted one cut GET's bytes short (CI, 2026-11-29); the connection's ActiveOpens in the
    namespace's TCP counters now makes the scan look."""
    with socket.create_server(("127.0.0.1", 0)) as listener, open("/dev/null") as spare:
        meter = WireMeter(listener.getsockname()[1])
        meter.start()
        try:
            meter._watch_step(closes_heard=True)
            meter._watch_step(closes_heard=True)  # nothing new: skipped
            spare_fd = spare.fileno()
            spare.close()
            client = _client(listener)
            assert client.fileno() == spare_fd  # the lowest free number: the file's
            server, _ = listener.accept()
            meter._watch_step(closes_heard=True)
            _cut_after(server, SENT)
            client.close()
            deadline = time.monotonic() + 10
            while meter.received() < SENT and time.monotonic() < deadline:
                time.sleep(0.01)  # the broadcast is sent from a kernel work queue
            assert meter.received() == SENT and meter.unseen_bytes == 0
        finally:
            meter.close()


def test_a_watch_runs_with_descriptors_past_1024():
    """A rank at 1,000+ ranks holds more than 1,024 descriptors (gloo's sockets): the watching
    thread waits with poll, which takes any; select raised ValueError there and the thread
    died, so no scan saw a connection after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    spare = [open("/dev/null") for _ in range(1100)]  # noqa: SIM115  (held open on purpose)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            meter = WireMeter(listener.getsockname()[1])
            meter.start()
            meter.watch(0.001)
            try:
                assert min(meter._wake_fds) > 1024
                assert _watched_cut(listener, meter) == SENT
                assert meter._thread is not None and meter._thread.is_alive()
            finally:
                meter.close()
    finally:
        for file in spare:
            file.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_load_that_raises_stops_its_meter():
    """The meter's watching thread stops with a load that raises (its sample, which would
    close it, is never built)."""
    from dcp_fsdp.rank.sample_build import wire_closed_on_error

    class Meter:
        closed = False
        hurried = False

        def hurry(self) -> None:
            self.hurried = True

        def close(self) -> None:
            self.closed = True

    meter = Meter()
    with pytest.raises(OSError), wire_closed_on_error(meter):
        assert meter.hurried  # told the load starts, as the barrier releases it
        raise OSError("a GET failed")
    assert meter.closed
    kept = Meter()
    with wire_closed_on_error(kept):
        pass
    assert not kept.closed  # closed by the sample's build


def test_a_watch_scans_fast_while_connections_open_and_longer_after_a_close():
    """The watch's schedule: a connect() keeps it fast for OPENING_WINDOW_S, a socket to the
    endpoint closing for RETRY_WINDOW_S (the client's retry follows its backoff), nothing
    leaves the window as it was; a window never shrinks."""
    assert fast_until(0.0, 10.0, closed=False, opened=False) <= 10.0  # slow from now
    assert fast_until(0.0, 10.0, closed=False, opened=True) == 10.0 + OPENING_WINDOW_S
    assert fast_until(0.0, 10.0, closed=True, opened=True) == 10.0 + RETRY_WINDOW_S
    assert fast_until(11.0, 10.0, closed=False, opened=True) == 11.0
    assert fast_until(10.5, 10.0, closed=False, opened=False) == 10.5
    assert OPENING_WINDOW_S < RETRY_WINDOW_S


def test_hurry_scans_fast_again_and_the_watch_still_sees_a_cut_connection():
    """`hurry()` (the load's start, after its barrier) reopens the fast window of a watch that
    had gone slow, wakes its thread (which drains the wake-up, not spinning on it), and the
    watch still counts a connection cut after it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        meter = WireMeter(listener.getsockname()[1])
        meter.start()
        meter.watch(0.001)
        try:
            meter._fast_until_s = 0.0  # gone slow
            before_s = time.monotonic()
            meter.hurry()
            assert meter._fast_until_s >= before_s + OPENING_WINDOW_S
            assert _watched_cut(listener, meter) == SENT
            assert meter._thread is not None and meter._thread.is_alive()
        finally:
            meter.close()
        assert meter._thread is None

