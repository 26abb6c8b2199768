"""`dcp-fsdp list`: the checkpoints under storage.uri / storage.path, complete or not, and
the multipart uploads left open there; `dcp-fsdp clean-uploads`: abort those uploads."""

from __future__ import annotations

from dcp_fsdp import log
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.preflight import check_fs_root, needs_embedded_server
from dcp_fsdp.storage import make_store


def _store(cfg: BenchmarkConfig, command: str):
    if needs_embedded_server(cfg):
        raise UserError(f"storage.uri is not set: give the location to {command}, e.g. "
                        "storage.uri=s3://my-bucket/ckpt (or storage=fs storage.path=DIR)")
    if cfg.storage.kind == StorageKind.fs:
        check_fs_root(cfg.storage.path, must_exist=True)  # list reads: it creates nothing
    store = make_store(cfg.storage)
    if cfg.storage.kind != StorageKind.fs:  # fs: listing needs no write access
        store.preflight()
    return store


def list_checkpoints(cfg: BenchmarkConfig) -> int:
    from tabulate import tabulate

    store = _store(cfg, "list")
    checkpoints = store.list_checkpoints()
    rows = [[c.suffix, "complete" if c.complete else "INCOMPLETE", f"{c.size_bytes / 2**20:.1f}",
             c.object_count, c.modified] for c in checkpoints]
    print(f"checkpoints under {store.location('')}")
    print(tabulate(rows, headers=["suffix", "state", "MiB", "objects", "modified (UTC)"],
                   tablefmt="github"))
    uploads = store.open_uploads()
    if uploads:
        by_suffix: dict[str, list] = {}
        for upload in uploads:
            by_suffix.setdefault(upload.suffix, []).append(upload)
        rows = [[suffix or "(root)", len(group), sum(u.part_count for u in group),
                 f"{sum(u.size_bytes for u in group) / 2**20:.1f}",
                 min(u.initiated for u in group)] for suffix, group in sorted(by_suffix.items())]
        print()
        print("open multipart uploads (stored and billed until aborted; "
              "`dcp-fsdp clean-uploads` with the same storage settings aborts them)")
        print(tabulate(rows, headers=["suffix", "uploads", "parts", "MiB", "oldest (UTC)"],
                       tablefmt="github"))
    return 0


def clean_uploads(cfg: BenchmarkConfig) -> int:
    """Abort every open multipart upload under the location (suffix=...: under that
    checkpoint only). A save running there now would fail: run it when none is."""
    store = _store(cfg, "clean")
    uploads = store.open_uploads(cfg.suffix)
    aborted = store.abort_uploads(cfg.suffix)
    where = store.location(cfg.suffix or "")
    size_mib = sum(u.size_bytes for u in uploads) / 2**20
    log.info(f"aborted {aborted} open multipart upload(s) under {where} "
             f"({sum(u.part_count for u in uploads)} parts, {size_mib:.1f} MiB)")
    return 0
