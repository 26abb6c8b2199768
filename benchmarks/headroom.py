"""Headroom: DCP's own reader against the tool's (storage.read_ahead=N), paired rounds.

  --store mock   in this process, the connector's in-memory mock client (no network, no
                 server): DCP's default reader (the connector's dcp_optimized, timed as a
                 rank times it) and the tool's reader over the same client, L660m-like bf16
                 tensors (1.26 GiB), alternating each round.
  --store tmpfs / s3
                 real `dcp-fsdp load` launches of one checkpoint saved once (L660m bf16 by
                 default) on tmpfs or the embedded SeaweedFS, alternating DCP's reader and
                 the tool's each round; the figure is the slowest rank's load duration_s.

Per variant: the paired ratio DCP's seconds / the variant's of each round (above 1: the
tool's reader is faster), their geometric mean with its 95 % CI (benchmarks/paired.py).

  python -m benchmarks.headroom --store mock --pairs 6
  python -m benchmarks.headroom --store s3 --nproc 2 --pairs 6
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.paired import PairedRatio, finally_on_sigterm, load_average

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def mock_loads(part_mib: int, read_aheads: list[int]) -> dict[str, Callable[[], float]]:
    """One timed load per variant over the connector's mock client (private: the benchmark
    alone reaches it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig, S3ReaderConstructor
    from s3torchconnector._s3client._mock_s3client import MockS3Client
    from s3torchconnector.dcp import S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    from dcp_fsdp.storage.timed_dcp import TimedLoadPlanner
    from dcp_fsdp.storage.timed_fs import ChunkTimedReadStream, TimedFileSystem
    from dcp_fsdp.storage.timed_s3 import (TimedDcpOptimizedConstructor, TimedReadAheadS3StorageReader,
                                           TimedReaderConstructor, TimedS3StorageReader)
    from dcp_fsdp.storage.timeline import HookTimeline

    region, path = "us-east-1", "s3://b/ckpt"
    config = S3ClientConfig(part_size=part_mib * MIB)
    client = MockS3Client(region, "b", s3client_config=config)

    class MemoryWriter(S3StorageWriter):
        def __init__(self) -> None:
            super().__init__(region=region, path=path, s3client_config=config)
            self.fs = S3FileSystem(region, s3_client=client)  # type: ignore[assignment]

    def on_mock(reader_class: type) -> type:
        class MemoryReader(reader_class):
            def __init__(self, timeline: HookTimeline, **kwargs: Any) -> None:
                super().__init__(timeline=timeline, region=region, path=path,
                                 s3client_config=config, **kwargs)
                self.fs = TimedFileSystem(S3FileSystem(region, s3_client=client,
                                                       reader_constructor=self._reader_constructor),
                                          timeline, ChunkTimedReadStream)
        return MemoryReader

    state = {f"layers.{i}.weight": torch.randn(1536, 4096).to(torch.bfloat16) for i in range(100)}
    state["embed"] = torch.randn(50432, 1536).to(torch.bfloat16)
    dcp.save(state, storage_writer=MemoryWriter())

    def timed(make: Callable[[HookTimeline], Any]) -> Callable[[], float]:
        def load() -> float:
            timeline = HookTimeline()
            reader = make(timeline)
            started = time.perf_counter()
            dcp.load(state, storage_reader=reader, planner=TimedLoadPlanner(timeline))
            return time.perf_counter() - started
        return load

    variants = {"dcp": timed(lambda t: on_mock(TimedS3StorageReader)(
        t, reader_constructor=TimedDcpOptimizedConstructor(t.storage_clock, 32 * MIB)))}
    def read_ahead_reader(n: int) -> Callable[[HookTimeline], Any]:
        return lambda t: on_mock(TimedReadAheadS3StorageReader)(
            t, read_ahead=n, group_bytes=64 * MIB,
            reader_constructor=TimedReaderConstructor(S3ReaderConstructor.range_based(), t.storage_clock))

    for n in read_aheads:
        variants[f"read_ahead={n}"] = timed(read_ahead_reader(n))
    return variants


def cli_loads(args: argparse.Namespace, storage: list[str], env: dict[str, str],
              log: Any) -> dict[str, Callable[[], float]]:
    """One `dcp-fsdp load` launch per variant of a checkpoint saved once here."""
    common = [f"model={args.model}", f"model.dtype={args.dtype}", f"nproc={args.nproc}",
              "progress=false", *storage]

    def launch(*settings: str) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as results:
            subprocess.run([sys.executable, "-m", "dcp_fsdp", *settings, *common,
                            f"results_dir={results}"], cwd=REPO, env=env, stdout=log,
                           stderr=log, check=True)
            (record,) = Path(results).glob("*.jsonl")
            return [json.loads(line) for line in record.read_text().splitlines()]

    (suffix,) = launch("save")[0]["suffixes"]

    def load(read_ahead: int) -> Callable[[], float]:
        def run() -> float:
            lines = launch("load", f"suffix={suffix}", f"storage.read_ahead={read_ahead}")
            return max(s["duration_s"] for s in lines[1:] if s.get("op") == "load")
        return run

    return {"dcp": load(0), **{f"read_ahead={n}": load(n) for n in args.read_ahead}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=("mock", "tmpfs", "s3"), default="mock")
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--part-mib", type=int, default=8, help="mock: the connector's part size")
    parser.add_argument("--read-ahead", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--log", default="headroom.log")
    args = parser.parse_args()
    finally_on_sigterm()
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = directory = None
    with open(args.log, "w") as log:
        if args.store == "mock":
            variants = mock_loads(args.part_mib, args.read_ahead)
        elif args.store == "tmpfs":
            directory = tempfile.mkdtemp(prefix="dcp-fsdp-headroom-", dir="/dev/shm")
            variants = cli_loads(args, ["storage=fs", f"storage.path={directory}"], env, log)
        else:
            from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

            server = EmbeddedS3(bucket="headroom")
            endpoint = server.start()
            env.update(endpoint.client_env())
            variants = cli_loads(args, [f"storage.uri=s3://{endpoint.bucket}/headroom"], env, log)
        try:
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            names = list(variants)
            for round_number in range(args.pairs):
                order = names[round_number % len(names):] + names[:round_number % len(names)]
                before = load_average()
                for name in order:
                    seconds[name].append(variants[name]())
                print(f"round {round_number + 1}/{args.pairs} load average {before:.2f}->"
                      f"{load_average():.2f}: " + ", ".join(f"{n} {seconds[n][-1]:.3f} s"
                                                           for n in names), flush=True)
        finally:
            if server is not None:
                server.stop()
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.store}, {args.model if args.store != 'mock' else 'L660m-like'} {args.dtype}, "
          f"{args.nproc} rank(s); ratio = DCP's reader s / the variant's s (above 1: faster)")
    for name in names[1:]:
        paired = PairedRatio.of(seconds["dcp"], seconds[name])
        print(f"{name:<14} median {sorted(seconds[name])[len(seconds[name]) // 2]:.3f} s "
              f"(DCP {sorted(seconds['dcp'])[len(seconds['dcp']) // 2]:.3f} s) "
              f"ratio {paired.mean:.3f} [{paired.low:.3f}, {paired.high:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
