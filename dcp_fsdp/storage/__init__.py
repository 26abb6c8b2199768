"""Checkpoint stores behind one contract (`base.CheckpointStore`): S3 and file system;
`layout` owns the checkpoint's objects, the suffix policy and loadability."""

from __future__ import annotations

from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.storage.base import CheckpointStore


def make_store(storage: StorageConfig, after_failure: bool = False) -> CheckpointStore:
    """The store for the settings. `after_failure` (the probes after a run failed): every S3
    control-plane request waits at most storage.connect_timeout_s for its answer, once."""
    if storage.kind == StorageKind.fs:
        from dcp_fsdp.storage.fs import FsStore

        return FsStore(storage)
    from dcp_fsdp.storage.s3 import S3Store

    return S3Store(storage, after_failure)
