"""Checkpoint stores behind one contract (`base.CheckpointStore`): S3 and file system.

`make_store(cfg.storage)` returns the store for the settings; `layout` owns the
checkpoint's objects, the suffix policy and loadability.
"""

from __future__ import annotations

from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.storage.base import CheckpointStore


def make_store(storage: StorageConfig) -> CheckpointStore:
    if storage.kind == StorageKind.fs:
        from dcp_fsdp.storage.fs import FsStore

        return FsStore(storage)
    from dcp_fsdp.storage.s3 import S3Store

    return S3Store(storage)
