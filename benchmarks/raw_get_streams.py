"""The raw ceiling's GET of one rank's objects: one stream, the objects in turn (as DCP's
reader reads a rank's files; the raw GET since 2026-11-25) against 4 streams (as it was,
storage.thread_count=4), in paired alternating rounds on the embedded SeaweedFS; 4 objects
of OBJ_MIB MiB each (L660m bf16 over 2 ranks with thread_count=4: ~158 MiB each).

  python -m benchmarks.raw_get_streams --object-mib 160 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dcp_fsdp.units import MIB

PART_MIB = 8
STREAMS = 4


def _read(area, names: list[str], streams: int) -> float:
    """MiB/s of one GET round of `names` with `streams` parallel streams (fresh client)."""
    client = area.open()
    started = time.monotonic()
    if streams == 1:
        received = sum(area.get(client, name) for name in names)
    else:
        with ThreadPoolExecutor(streams) as pool:
            received = sum(pool.map(lambda name: area.get(client, name), names))
    return received / MIB / (time.monotonic() - started)


def main() -> int:
    from s3torchconnector import S3ClientConfig

    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3
    from dcp_fsdp.storage.raw import S3RawArea

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--object-mib", type=int, default=158)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    server = EmbeddedS3(bucket="raw-get-streams")
    endpoint = server.start()
    os.environ.update(endpoint.client_env())
    try:
        area = S3RawArea(endpoint.bucket, "streams", "us-east-1", lambda: S3ClientConfig(
            force_path_style=True, part_size=PART_MIB * MIB))
        client, payload = area.open(), os.urandom(PART_MIB * MIB)
        names = [f"object-{i}" for i in range(STREAMS)]
        for name in names:
            area.put(client, name, (payload for _ in range(args.object_mib // PART_MIB)))
        rates: dict[int, list[float]] = {1: [], STREAMS: []}
        for index in range(args.rounds):  # alternate which goes first
            for streams in ((1, STREAMS) if index % 2 == 0 else (STREAMS, 1)):
                rates[streams].append(_read(area, names, streams))
    finally:
        server.stop()
    for streams, values in rates.items():
        print(f"{streams} stream(s): median {statistics.median(values):.1f} MiB/s "
              f"(min {min(values):.1f}, max {max(values):.1f})")
    ratios = [one / many for one, many in zip(rates[1], rates[STREAMS])]
    print(f"1 / {STREAMS} streams per round: median {statistics.median(ratios):.2f} "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
