"""What the wire meter's watching thread costs: its CPU time over a 10 s watch, in a process
shaped like a rank (torch imported, about 100 descriptors, 16 connections to the "endpoint").

The thread's user time is about the share of the GIL it takes from the load it measures (its
system time is spent in syscalls, the GIL released); user + system is its share of a core
(process/wire_meter.py, WATCH_PERIOD_S).

  python -m benchmarks.wire_meter_cost --period-s 0.005
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import psutil
import torch  # noqa: F401  (a rank's process: torch loaded)

from dcp_fsdp.process.wire_meter import WireMeter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--period-s", type=float, default=0.005)
    parser.add_argument("--files", type=int, default=60, help="extra open descriptors")
    parser.add_argument("--watch-s", type=float, default=10.0)
    args = parser.parse_args()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    accepted = [server.accept()[0] for _ in range(16)]
    files = [open("/proc/self/status") for _ in range(args.files)]
    meter = WireMeter(port)
    meter.start()
    meter.watch(args.period_s)
    thread = meter._thread  # noqa: SLF001  (this benchmark reads its own thread's CPU)
    assert thread is not None

    def cpu_s() -> tuple[float, float]:
        found = [t for t in psutil.Process().threads() if t.id == thread.native_id]
        return (found[0].user_time, found[0].system_time) if found else (0.0, 0.0)

    before, started = cpu_s(), time.monotonic()
    time.sleep(args.watch_s)
    after, wall = cpu_s(), time.monotonic() - started
    meter.close()
    user_s, system_s = after[0] - before[0], after[1] - before[1]
    print(f"{len(os.listdir('/proc/self/fd'))} descriptors, a scan every {args.period_s * 1000:g} ms "
          f"over {wall:.1f} s: user {100 * user_s / wall:.2f} % of a core (the GIL's share), "
          f"user + system {100 * (user_s + system_s) / wall:.2f} %")
    for connection in [*clients, *accepted, server]:
        connection.close()
    for file in files:
        file.close()


if __name__ == "__main__":
    main()
