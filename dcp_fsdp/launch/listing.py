"""`dcp-fsdp list`: the checkpoints under storage.uri / storage.path, complete or not."""

from __future__ import annotations

from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.preflight import check_fs_root, needs_embedded_server
from dcp_fsdp.storage import make_store


def list_checkpoints(cfg: BenchmarkConfig) -> int:
    from tabulate import tabulate

    if needs_embedded_server(cfg):
        raise UserError("storage.uri is not set: give the location to list, e.g. "
                        "storage.uri=s3://my-bucket/ckpt (or storage=fs storage.path=DIR)")
    if cfg.storage.kind == StorageKind.fs:
        check_fs_root(cfg.storage.path, must_exist=True)  # list reads: it creates nothing
    store = make_store(cfg.storage)
    if cfg.storage.kind != StorageKind.fs:  # fs: listing needs no write access
        store.preflight()
    checkpoints = store.list_checkpoints()
    rows = [[c.suffix, "complete" if c.complete else "INCOMPLETE", f"{c.size_bytes / 2**20:.1f}",
             c.object_count, c.modified] for c in checkpoints]
    print(f"checkpoints under {store.location('')}")
    print(tabulate(rows, headers=["suffix", "state", "MiB", "objects", "modified (UTC)"],
                   tablefmt="github"))
    return 0
