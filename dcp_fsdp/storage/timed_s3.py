"""The connector's DCP writer and reader, timed (storage/timed_dcp.py says how), in a module of
its own so that only ranks of an S3 store import the connector. A load waits for storage in the
native stream's chunk iterator (the reader's copies of the chunks are the rank's work): the
reader constructors here (the connector's `reader_constructor` hook) clock that iterator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
from s3torchconnector.s3reader.constructor import DCPOptimizedConstructor

from dcp_fsdp.storage.read_ahead import ReadAhead
from dcp_fsdp.storage.timed_dcp import TimedReader, TimedWriter
from dcp_fsdp.storage.timed_fs import ChunkTimedReadStream
from dcp_fsdp.storage.timeline import BusyClock


class TimedS3StorageWriter(TimedWriter, S3StorageWriter):
    pass  # the timeline= argument and set-up: timed_dcp._TimedPlanning.__init__


class TimedS3StorageReader(TimedReader, S3StorageReader):
    read_stream = ChunkTimedReadStream  # the client is clocked at its chunk iterator


class TimedReadAheadS3StorageReader(TimedReader, ReadAhead, S3StorageReader):
    """The tool's reader (storage.read_ahead=N) through the connector: built with its
    range-based reader constructor, so each group is one ranged GET (storage/s3_clients.py)."""

    read_stream = ChunkTimedReadStream


def _clocked_chunks(stream: Iterator[bytes], clock: BusyClock) -> Iterator[bytes]:
    """A GET's body as the connector's native stream yields it, each `next()` on `clock`."""
    while True:
        with clock:
            chunk = next(stream, None)
        if chunk is None:
            return
        yield chunk


def _clocked_get_stream(get_stream: Callable[..., Iterator[bytes]], clock: BusyClock,
                        *args: Any, **kwargs: Any) -> Iterator[bytes]:
    """The connector's `get_stream(start=None, end=None)` with its stream clocked (the request
    is sent when the stream is made: that call is clocked too)."""
    with clock:
        stream = get_stream(*args, **kwargs)
    return _clocked_chunks(stream, clock)


class TimedDcpOptimizedConstructor(DCPOptimizedConstructor):
    """The connector's default DCP reader (`dcp_optimized`), its chunk iterator clocked."""

    def __init__(self, clock: BusyClock, max_gap_size: int | float) -> None:
        super().__init__(max_gap_size=max_gap_size)
        self._clock = clock

    def __call__(self, bucket: str, key: str, get_object_info: Any, get_stream: Any) -> Any:
        return super().__call__(bucket, key, get_object_info,
                                functools.partial(_clocked_get_stream, get_stream, self._clock))


class TimedReaderConstructor(functools.partial):
    """The connector's sequential or range-based reader constructor (a `partial` of its reader
    class, which the connector reads back for its user agent), its chunk iterator clocked."""

    def __new__(cls, inner: Any, clock: BusyClock) -> TimedReaderConstructor:
        return super().__new__(cls, inner.func, *inner.args, **inner.keywords)

    def __init__(self, inner: Any, clock: BusyClock) -> None:
        self._clock = clock

    def __call__(self, bucket: str, key: str, get_object_info: Any, get_stream: Any) -> Any:
        return super().__call__(bucket, key, get_object_info,
                                functools.partial(_clocked_get_stream, get_stream, self._clock))
