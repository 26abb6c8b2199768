"""The connector's DCP writer and reader, timed (storage/timed_dcp.py says how). A module
of its own so that only ranks of an S3 store import the connector; its classes are at
module level so that the process checkpointer can pickle a writer into its daemon."""

from __future__ import annotations

from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

from dcp_fsdp.storage.timed_dcp import TimedReader, TimedWriter


class TimedS3StorageWriter(TimedWriter, S3StorageWriter):
    pass  # the timeline= argument and set-up: timed_dcp._TimedPlanning.__init__


class TimedS3StorageReader(TimedReader, S3StorageReader):
    pass
