"""torch's fsspec writer and reader and multi-storage-client's, timed as the connector's are
(storage/timed_dcp.py says how): module-level classes, so that the process checkpointer can
pickle a writer into its daemon. Ranks of storage.client=fsspec|msc import this module only."""

from __future__ import annotations

from typing import Any, cast

from multistorageclient import resolve_storage_client
from multistorageclient.contrib.torch import MultiStorageFileSystemReader, MultiStorageFileSystemWriter
from multistorageclient.types import Range

from dcp_fsdp.compat import fsspec_dcp_classes
from dcp_fsdp.storage.read_ahead import ReadAhead
from dcp_fsdp.storage.timed_dcp import TimedReader, TimedWriter
from dcp_fsdp.storage.timed_fs import DownloadingReadStream, FetchingReadStream, client_file_system

FsspecWriter, FsspecReader = fsspec_dcp_classes()


class TimedFsspecWriter(TimedWriter, FsspecWriter):  # type: ignore[valid-type,misc]
    pass  # the timeline= argument and set-up: timed_dcp._TimedPlanning.__init__


class TimedFsspecReader(TimedReader, FsspecReader):  # type: ignore[valid-type,misc]
    read_stream = FetchingReadStream  # s3fs waits inside read()


class TimedReadAheadFsspecReader(TimedReader, ReadAhead, FsspecReader):  # type: ignore[valid-type,misc]
    """The tool's reader (storage.read_ahead=N) through s3fs: `cat_file(start, end)` per
    group (one ranged GET; its file objects' read-ahead cache would fetch a block more)."""

    def fetch_into(self, path: Any, start: int, target: memoryview) -> None:
        s3fs = cast(Any, client_file_system(self)).fs  # torch's fsspec FileSystem holds s3fs's
        self.clocked_into(target, lambda: s3fs.cat_file(str(path), start=start, end=start + len(target)))


class TimedMscWriter(TimedWriter, MultiStorageFileSystemWriter):
    pass


class TimedMscReader(TimedReader, MultiStorageFileSystemReader):
    read_stream = DownloadingReadStream  # MSC waits in its first call, then in ranged reads


class TimedReadAheadMscReader(TimedReader, ReadAhead, MultiStorageFileSystemReader):
    """The tool's reader (storage.read_ahead=N) through multi-storage-client: its
    `read(byte_range=...)` per group (its file objects download whole objects)."""

    def fetch_into(self, path: Any, start: int, target: memoryview) -> None:
        client, key = resolve_storage_client(str(path))
        self.clocked_into(target, lambda: client.read(key, byte_range=Range(offset=start,
                                                                             size=len(target))))
