"""The timed writer's and reader's file system and object streams (storage/timeline.py says
what they record; docs/architecture.md, "Timing DCP"): subclasses of torch's `FileSystemBase`
and of `io.BufferedIOBase` that hold the client's own file system or stream (`inner`) and
implement each method DCP calls by name (untimed ones: `base.delegated`). Nothing is forwarded
by a catch-all attribute lookup and nothing is assigned on the client's objects. Ranks only (imports torch).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import threading
from collections.abc import Callable, Generator
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from dcp_fsdp.compat import msc_reads_ranged
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.base import delegated
from dcp_fsdp.storage.layout import METADATA_NAME
from dcp_fsdp.storage.timeline import HookTimeline

StrPath = str | os.PathLike


class _TimedStream(io.BufferedIOBase):
    """The calls a timed stream passes untimed to `inner`, the client's stream."""

    def __init__(self, inner: io.IOBase, timeline: HookTimeline) -> None:
        self.inner = inner  # first: io's finalizer reads `closed`
        super().__init__()
        self._timeline = timeline

    @property
    def closed(self) -> bool:
        return self.inner.closed

    readable = delegated("inner", io.IOBase.readable)
    writable = delegated("inner", io.IOBase.writable)
    seekable = delegated("inner", io.IOBase.seekable)
    seek = delegated("inner", io.IOBase.seek)
    tell = delegated("inner", io.IOBase.tell)
    flush = delegated("inner", io.IOBase.flush)
    fileno = delegated("inner", io.IOBase.fileno)  # io.UnsupportedOperation where it has no descriptor
    close = delegated("inner", io.IOBase.close)


class TimedWriteStream(_TimedStream):
    """A write stream: write() and close() timed on the stream clock (the upload), the bytes
    written counted, the first error either raises noted on the timeline."""

    def _uploading(self, work: Callable[[], Any]) -> Any:
        try:
            with self._timeline.storage_clock:
                return work()
        except Exception as error:  # the first one only: DCP's own error may hide it
            if self._timeline.stream_error is None:
                self._timeline.stream_error = f"{type(error).__name__}: {' '.join(str(error).split())[:2000]}"
            raise

    def write(self, data: Any, /) -> int:
        written = self._uploading(lambda: self.inner.write(data))
        if hasattr(data, "__len__"):
            self._timeline.moved.add(len(data))
        return memoryview(data).nbytes if written is None else written

    def close(self) -> None:
        self._uploading(self.inner.close)


class TimedReadStream(_TimedStream):
    """A read stream of a file system: read(), readinto() and readline() timed on the storage
    clock and their bytes counted. Subclasses clock where their client waits (`_clocked`)."""

    def _clocked(self, call: str) -> bool:
        """Whether this data call is time the client spends on storage."""
        return True

    def _call(self, call: str, *args: Any) -> Any:
        return self._timed(call, functools.partial(getattr(self.inner, call), *args))

    def _timed(self, call: str, work: Callable[[], Any]) -> Any:
        with self._timeline.storage_clock if self._clocked(call) else contextlib.nullcontext():
            return work()

    def _counted(self, call: str, *args: Any) -> Any:
        """The client's data `call`, its bytes counted (a count, or the bytes returned)."""
        result = self._call(call, *args)
        if result:
            self._timeline.moved.add(result if isinstance(result, int) else len(result))
        return result

    def read(self, size: int | None = -1, /) -> bytes:
        return self._counted("read", -1 if size is None else size)

    def readinto(self, buffer: Any, /) -> int:
        return self._counted("readinto", buffer) or 0

    def readline(self, size: int | None = -1, /) -> bytes:
        return self._counted("readline", -1 if size is None else size)


class FetchingReadStream(TimedReadStream):
    """torch's fsspec reader over s3fs: s3fs waits inside read(); its readinto() is read() and
    a copy, done here so that the copy (into torch's fresh storage) is the rank's, not storage's."""

    def readinto(self, buffer: Any, /) -> int:
        target = memoryview(buffer).cast("B")
        data = self.read(target.nbytes)
        target[:len(data)] = data
        return len(data)


class DownloadingReadStream(FetchingReadStream):
    """multi-storage-client's object file: below its memory limit every call first waits for
    the whole object's download; above it, each read() is a ranged GET. So the first call of
    any kind is clocked, and read() after it only where reads are ranged."""

    _ranged: bool | None = None  # known once the first call has returned

    def _clocked(self, call: str) -> bool:
        return self._ranged is None or (self._ranged and call in ("read", "readline"))

    def _timed(self, call: str, work: Callable[[], Any]) -> Any:
        result = super()._timed(call, work)
        if self._ranged is None:
            self._ranged = msc_reads_ranged(self.inner)
            self._timeline.msc_reads.add("ranged" if self._ranged else "whole")
        return result

    @property
    def closed(self) -> bool:
        return bool(self._timed("closed", lambda: self.inner.closed))

    def seekable(self) -> bool:
        return bool(self._call("seekable"))

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        return int(self._call("seek", offset, whence))

    def tell(self) -> int:
        return int(self._call("tell"))


class ChunkTimedReadStream(TimedReadStream):
    """The connector's reader: its chunk iterator is clocked (storage/timed_s3.py); here only counted."""

    def _clocked(self, call: str) -> bool:
        return False


class TimedFileSystem(FileSystemBase):
    """A DCP writer's or reader's file system (`inner`) with its object streams timed and counted."""

    def __init__(self, inner: FileSystemBase, timeline: HookTimeline,
                 read_stream: type[TimedReadStream] = TimedReadStream) -> None:
        self.inner = inner
        self.timeline = timeline
        self.read_stream = read_stream  # where this client waits on a read (the classes above)
        self._lock = threading.Lock()
        # the screened .metadata's SHA-256 (expect_metadata): DCP's read must be those bytes
        self.metadata_sha256: str | None = None
        self.metadata_changed: str | None = None  # why DCP's read was refused (its own error hides it)

    def __reduce__(self) -> tuple[Any, ...]:  # a lock does not pickle (process checkpointer)
        return type(self), (self.inner, self.timeline, self.read_stream)

    @contextlib.contextmanager
    def create_stream(self, path: StrPath, mode: str) -> Generator[io.IOBase, None, None]:
        if self.metadata_sha256 and "r" in mode and str(path).rsplit("/", 1)[-1] == METADATA_NAME:
            yield io.BytesIO(self._screened_metadata(path))
            return
        with self.inner.create_stream(path, mode) as stream:
            if "w" in mode:
                timed = TimedWriteStream(stream, self.timeline)
                yield timed
                with contextlib.suppress(Exception):  # a stream that cannot tell (closed built-in file)
                    size = int(timed.tell())
                    with self._lock:
                        self.timeline.object_bytes[str(path)] = size
            else:
                yield self.read_stream(stream, self.timeline) if "r" in mode else stream

    def _screened_metadata(self, path: StrPath) -> bytes:
        """DCP's read of `.metadata`, timed and counted, if it is the file screened (else MetadataChanged)."""
        with self.inner.create_stream(path, "rb") as stream:
            data = TimedReadStream(stream, self.timeline).read()
        if hashlib.sha256(data).hexdigest() != self.metadata_sha256:
            self.metadata_changed = (f"{path}: not the .metadata screened before the load "
                                     f"({len(data)} bytes, another SHA-256): it was replaced "
                                     "since, and was not unpickled; load again")
            raise MetadataChanged(self.metadata_changed)
        return data

    concat_path = delegated("inner", FileSystemBase.concat_path)
    rename = delegated("inner", FileSystemBase.rename)
    init_path = delegated("inner", FileSystemBase.init_path)
    mkdir = delegated("inner", FileSystemBase.mkdir)
    exists = delegated("inner", FileSystemBase.exists)
    rm_file = delegated("inner", FileSystemBase.rm_file)

    def validate_checkpoint_id(self, checkpoint_id: StrPath) -> bool:  # type: ignore[override]
        # a classmethod in torch's interface; the client's (its class's) answers here
        return self.inner.validate_checkpoint_id(checkpoint_id)

    def ls(self, path: StrPath) -> list[str]:
        """Not in torch 2.13's abstract set (hf_storage calls it); the client's where it has one."""
        inner: Any = self.inner  # FileSystem, fsspec's and MSC's define it; S3FileSystem does not
        return list(inner.ls(path))


class MetadataChanged(UserError):
    """The .metadata DCP read is not the one screened before the load."""


def timed_file_system(storage_io: Any) -> TimedFileSystem | None:
    """The timed file system of a DCP writer or reader (None: harness_off=hooks, DCP's own)."""
    fs = getattr(storage_io, "fs", None)
    return fs if isinstance(fs, TimedFileSystem) else None


def expect_metadata(storage_io: Any, sha256: str) -> None:
    """A timed reader unpickles only a `.metadata` of this SHA-256, the screened file's."""
    fs = timed_file_system(storage_io)
    if fs is not None and sha256:
        fs.metadata_sha256 = sha256


def metadata_changed(storage_io: Any) -> str | None:
    """Why a timed reader refused DCP's read of `.metadata` (expect_metadata), if it did."""
    fs = timed_file_system(storage_io)
    return fs.metadata_changed if fs is not None else None


def client_file_system(storage_io: Any) -> FileSystemBase:
    """The client's own file system of a DCP writer or reader, timed or not."""
    fs = storage_io.fs
    return fs.inner if isinstance(fs, TimedFileSystem) else fs
