"""torch's fsspec writer and reader and multi-storage-client's, timed as the connector's are
(storage/timed_dcp.py says how): module-level classes, so that the process checkpointer can
pickle a writer into its daemon. Ranks of storage.client=fsspec|msc import this module only."""

from __future__ import annotations

from multistorageclient.contrib.torch import MultiStorageFileSystemReader, MultiStorageFileSystemWriter

from dcp_fsdp.compat import fsspec_dcp_classes
from dcp_fsdp.storage.timed_dcp import TimedReader, TimedWriter
from dcp_fsdp.storage.timed_fs import DownloadingReadStream, FetchingReadStream

FsspecWriter, FsspecReader = fsspec_dcp_classes()

__all__ = ["FsspecReader", "FsspecWriter", "MultiStorageFileSystemReader",
           "MultiStorageFileSystemWriter", "TimedFsspecReader", "TimedFsspecWriter",
           "TimedMscReader", "TimedMscWriter"]


class TimedFsspecWriter(TimedWriter, FsspecWriter):  # type: ignore[valid-type,misc]
    pass  # the timeline= argument and set-up: timed_dcp._TimedPlanning.__init__


class TimedFsspecReader(TimedReader, FsspecReader):  # type: ignore[valid-type,misc]
    read_stream = FetchingReadStream  # s3fs waits inside read()


class TimedMscWriter(TimedWriter, MultiStorageFileSystemWriter):
    pass


class TimedMscReader(TimedReader, MultiStorageFileSystemReader):
    read_stream = DownloadingReadStream  # MSC waits in its first call, then in ranged reads
