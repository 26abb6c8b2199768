"""A bare rank: barrier + dcp.save / dcp.load of the same FSDP state dict, nothing else.

The comparison point of `benchmarks/harness_cost.py` (the
awslabs peer's method: whole model bytes / the rank's bare dcp.save time). No hooks, no
request log, no watchdog, no byte counting, none of the tool's timing code:
s3torchconnector's S3StorageWriter/Reader (or DCP's FileSystemWriter/Reader) built
directly. The model is built by dcp_fsdp's own builder (untimed) so the state dict holds
the very shapes and values the tool saves; the builder leaves the host allocator as a plain
`normal_` initialisation does (models/values.py, issue 19). The connector's client is built
before the barrier, as the tool does, so both time only the save and the load.

Run under torchrun (it is started by benchmarks/harness_cost.py):
  torchrun --standalone --nproc-per-node 2 -m benchmarks.bare_dcp MODEL DTYPE URI OUT.json [ITERATIONS [CLIENT]]
CLIENT: s3torchconnector (default), fsspec or msc (storage.client's choices).
Storage settings: the defaults of `dcp-fsdp` (part 8 MiB, 10 Gbit/s, 10 attempts, 1 thread,
dcp_optimized reader); the endpoint from AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def other_client_factories(client: str, uri: str):
    """torch's fsspec path or multi-storage-client with the tool's defaults for them
    (fsspec: sync_files off, 50 MiB blocks, 10 connections; msc: 32 MiB parts, 64 MiB
    threshold, 8 threads), built by their own constructors. The endpoint from
    AWS_ENDPOINT_URL; MSC's profile file from MSC_CONFIG (harness_cost.py writes it)."""
    if client == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        options: dict[str, Any] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                                   "client_kwargs": {"region_name": os.environ.get("AWS_REGION",
                                                                                   "us-east-1")},
                                   "config_kwargs": {"max_pool_connections": 10,
                                                     "s3": {"addressing_style": "path"}},
                                   "default_block_size": 50 * 2**20}
        return (lambda path: FsspecWriter(path, sync_files=False, thread_count=1, overwrite=False,
                                          **options),
                lambda path: FsspecReader(path, **options))
    from multistorageclient.contrib.torch import MultiStorageFileSystemReader, MultiStorageFileSystemWriter

    def msc_path(path: str) -> str:
        return "msc://bench/" + path[len("s3://"):].split("/", 1)[1]
    return (lambda path: MultiStorageFileSystemWriter(msc_path(path), sync_files=False,
                                                      thread_count=1, overwrite=False),
            lambda path: MultiStorageFileSystemReader(msc_path(path), thread_count=1))


def main() -> int:
    preset, dtype_name, uri, out = sys.argv[1:5]
    iterations = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.config.schema import CheckpointState, Dtype
    from dcp_fsdp.models.build import build_sharded_model
    from dcp_fsdp.rank.state import state_bytes
    from dcp_fsdp.models.build import dcp_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sharded = build_sharded_model(preset, Dtype(dtype_name), CheckpointState.model,
                                  __import__("torch").device("cpu"), dist.get_world_size(), 0)
    state_dict = dcp_state_dict(sharded.model, sharded.optimizer)
    model_bytes = state_bytes(state_dict)

    client = sys.argv[6] if len(sys.argv) > 6 else "s3torchconnector"
    if uri.startswith("s3://") and client != "s3torchconnector":
        writer_factory, reader_factory = other_client_factories(client, uri)
    elif uri.startswith("s3://"):
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        region = os.environ.get("AWS_REGION", "us-east-1")
        config = S3ClientConfig(throughput_target_gbps=10.0, part_size=8 * 2**20,
                                force_path_style=True, max_attempts=10)
        def writer_factory(path):
            return S3StorageWriter(region=region, path=path, s3client_config=config,
                                   thread_count=1, overwrite=False)

        def reader_factory(path):
            return S3StorageReader(region=region, path=path, s3client_config=config,
                                   reader_constructor=S3ReaderConstructor.dcp_optimized())
    else:
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        def writer_factory(path):
            return FileSystemWriter(path, thread_count=1, overwrite=False)

        def reader_factory(path):
            return FileSystemReader(path)

    def writer_path(iteration: int) -> str:
        return uri if iteration == 0 else f"{uri}-{iteration + 1}"

    writer = writer_factory(uri)

    def warm(storage_io) -> None:
        fs = getattr(storage_io, "fs", None)
        inner = getattr(fs, "fs", None)
        if inner is not None and hasattr(inner, "connect"):  # torch's fsspec path: s3fs's client
            inner.connect()
        if client == "msc":  # MSC's client for the profile, as the tool's warm-up builds it
            from multistorageclient.shortcuts import resolve_storage_client

            resolve_storage_client(str(storage_io.path))
        native = getattr(fs, "_client", None)
        if native is not None and hasattr(native, "_client"):
            # builds the native client, as the tool's warm-up does through compat.py (this script
            # imports nothing of the package on purpose)
            native._client  # noqa: B018, SLF001

    def faults() -> int:  # read outside the timer: minor page faults of this process
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    save_s, load_s, save_faults, load_faults = [], [], [], []
    for iteration in range(iterations):
        if iteration:  # a new checkpoint per save, as the tool's iterations
            writer = writer_factory(f"{uri}-{iteration + 1}")
        warm(writer)
        before = faults()
        dist.barrier()
        begin = time.monotonic()
        dcp.save(state_dict, storage_writer=writer)
        save_s.append(time.monotonic() - begin)
        save_faults.append(faults() - before)
        reader = reader_factory(writer_path(iteration))
        warm(reader)
        before = faults()
        dist.barrier()
        begin = time.monotonic()
        dcp.load(state_dict, storage_reader=reader)
        load_s.append(time.monotonic() - begin)
        load_faults.append(faults() - before)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "save_s": save_s, "load_s": load_s,
                                      "save_minor_faults": save_faults,
                                      "load_minor_faults": load_faults})
    if rank == 0:
        with open(out, "w") as sink:
            json.dump({"model_bytes": model_bytes, "ranks": gathered}, sink)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as the tool's ranks: skip native teardown (CRT threads)


if __name__ == "__main__":
    sys.exit(main())
