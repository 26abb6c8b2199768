"""What the wire meter's watching thread costs: its CPU time over a 10 s watch, in a process
shaped like a rank (torch imported, about 100 descriptors, 16 connections to the "endpoint").

The thread takes the GIL for every scan, so its CPU share is also the share of the GIL it
takes from the load it measures (process/wire_meter.py, WATCH_PERIOD_S).

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

    def cpu_s() -> float:
        found = [t for t in psutil.Process().threads() if t.id == thread.native_id]
        return found[0].user_time + found[0].system_time if found else 0.0

    before, started = cpu_s(), time.monotonic()
    time.sleep(args.watch_s)
    used, wall = cpu_s() - before, time.monotonic() - started
    meter.close()
    print(f"{len(os.listdir('/proc/self/fd'))} descriptors, a scan every {args.period_s * 1000:g} ms: "
          f"{used:.3f} CPU s over {wall:.1f} s = {100 * used / wall:.1f} % of a core")
    for connection in [*clients, *accepted, server]:
        connection.close()
    for file in files:
        file.close()


if __name__ == "__main__":
    main()
