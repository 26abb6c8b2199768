"""multi-storage-client's DCP writer as this tool builds it (storage.client=msc;
storage/s3_clients.py `MscClient`): a subclass of MSC's own writer with a `.metadata` any
client can load. torch's writer pickles `StorageMeta(checkpoint_id=self.checkpoint_id)` into
`.metadata`, and MSC's checkpoint id is its `MultiStoragePath`: unpickling it needs
multistorageclient and the writer's MSC profile, so the connector and fsspec failed on an MSC
save ("Profile not found"). `PortableMscWriter` stores the id as its string
(`msc://dcp-fsdp/<prefix>/<suffix>`), as a local save stores a path.

Ranks only (imports torch and multistorageclient).
"""

from __future__ import annotations

from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from dcp_fsdp.storage.timed_clients import TimedMscWriter

__all__ = ["PortableMscWriter", "TimedPortableMscWriter"]


class PortableMscWriter(MultiStorageFileSystemWriter):
    """MSC's writer whose `.metadata` names its checkpoint by a string, not an MSC path."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and meta.checkpoint_id is not None:
            meta.checkpoint_id = str(meta.checkpoint_id)
        return meta


class TimedPortableMscWriter(TimedMscWriter, PortableMscWriter):
    pass  # timed as TimedMscWriter (timeline=), portable .metadata

