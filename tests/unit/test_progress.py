"""The heartbeat: beats while an operation runs, says bytes, rate and time, then stops."""

from __future__ import annotations

import time

from dcp_fsdp.units import MIB
from dcp_fsdp.process.progress import Heartbeat


def test_heartbeat_beats_while_running_and_stops_after():
    lines: list[str] = []
    moved = [0]
    with Heartbeat("save iteration 2", lambda: moved[0], 100 * MIB, 0.05, lines.append) as beat:
        for _ in range(5):
            moved[0] += 10 * MIB
            time.sleep(0.05)
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count == beat.beats and count >= 2
    assert lines[-1].startswith("save iteration 2: still running, rank 0 moved ")
    assert " of 100.0 MiB in " in lines[-1] and "MiB/s)" in lines[-1]


def test_a_heartbeat_says_when_nothing_has_moved_for_a_while():
    """A killed server under s3fs: the same count for 20 s, with no hint (issue 49)."""
    moved = [5 * MIB]
    beat = Heartbeat("save iteration 1", lambda: moved[0], 100 * MIB, 1, lambda _: None)
    assert "nothing moved" not in beat.line(1.0)
    assert "nothing moved" not in beat.line(9.0)
    assert "; nothing moved for 11 s: the endpoint may be down" in beat.line(12.0)
    moved[0] += MIB
    assert "nothing moved" not in beat.line(13.0)


def test_line_without_an_expected_total():
    beat = Heartbeat("load iteration 1", lambda: 3 * MIB, None, 10, lambda _: None)
    assert beat.line(2.0) == ("load iteration 1: still running, rank 0 moved 3.0 MiB in 2.0 s "
                              "(1.5 MiB/s)")


def test_the_wire_meter_counts_what_the_kernel_moved_on_the_endpoints_sockets_only():
    """process/wire_meter.py on real loopback sockets: bytes the peer acknowledged and bytes
    received, from the operation's start, on connections to the endpoint's port only (a
    connection to another port, like the collectives', is not counted)."""
    import socket

    from dcp_fsdp.process.wire_meter import WireMeter, endpoint_port

    assert endpoint_port("http://127.0.0.1:8333") == 8333
    assert endpoint_port("https://s3.example.com") == 443 and endpoint_port(None) == 443
    with socket.create_server(("127.0.0.1", 0)) as storage, \
            socket.create_server(("127.0.0.1", 0)) as other:
        meter = WireMeter(storage.getsockname()[1])
        assert meter.available()
        with socket.create_connection(storage.getsockname()) as client, \
                socket.create_connection(other.getsockname()) as elsewhere:
            server, _ = storage.accept()
            peer, _ = other.accept()
            with server, peer:
                client.sendall(b"x" * 1000)  # before the start: not counted
                server.recv(4096)
                meter.start()
                client.sendall(b"y" * 300_000)
                elsewhere.sendall(b"z" * 500_000)
                got = 0
                while got < 300_000:
                    got += len(server.recv(1 << 20))
                server.sendall(b"w" * 70_000)
                received = 0
                while received < 70_000:
                    received += len(client.recv(1 << 20))
                # acknowledged and received are the kernel's own, settled after the reads
                deadline = time.monotonic() + 10
                while meter.acked() < 300_000 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert meter.acked() == 300_000
                assert meter.received() == 70_000


def test_a_rank_that_read_more_than_its_share_is_not_said_as_more_than_all():
    """A resharded load reads saved items whole for parts of them: the heartbeat said "read
    1263.0 of 631.3 MiB" (its share of the state as the total)."""
    beat = Heartbeat("load iteration 1", lambda: 300 * MIB, 200 * MIB, 10, lambda _: None,
                     verb="read")
    assert beat.line(2.0) == ("load iteration 1: still running, rank 0 read 300.0 MiB (its "
                              "share of the state: 200.0 MiB) in 2.0 s (150.0 MiB/s)")
    beat = Heartbeat("load iteration 1", lambda: 100 * MIB, 200 * MIB, 10, lambda _: None)
    assert " moved 100.0 of 200.0 MiB in 2.0 s " in beat.line(2.0)
