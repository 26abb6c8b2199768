"""The connector's DCP writer and reader, timed (storage/timed_dcp.py says how). A module
of its own so that only ranks of an S3 store import the connector; its classes are at
module level so that the process checkpointer can pickle a writer into its daemon."""

from __future__ import annotations

from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

from dcp_fsdp.storage.timed_dcp import TimedReader, TimedWriter
from dcp_fsdp.storage.timeline import HookTimeline


class TimedS3StorageWriter(TimedWriter, S3StorageWriter):
    def __init__(self, *args, timeline: HookTimeline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start_timing(timeline)


class TimedS3StorageReader(TimedReader, S3StorageReader):
    def __init__(self, *args, timeline: HookTimeline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start_timing(timeline)
