"""The timed file system and object streams (storage/timed_fs.py): subclasses of torch's
FileSystemBase and of io.BufferedIOBase over the client's own, timing and counting what the
patched streams did, leaving the client's objects as they were, and crossing a pickle."""

from __future__ import annotations

import io
import pickle
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from dcp_fsdp.storage.timed_dcp import TimedFileSystemReader, TimedFileSystemWriter
from dcp_fsdp.storage.timed_fs import (
    TimedFileSystem,
    TimedReadStream,
    TimedWriteStream,
    client_file_system,
)
from dcp_fsdp.storage.timeline import HookTimeline


class SlowWriter(io.RawIOBase):
    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        time.sleep(0.01)
        self.data += data
        return len(data)

    def tell(self) -> int:
        return len(self.data)


class Source(io.RawIOBase):  # RawIOBase.read() calls self.readinto()
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def test_a_write_stream_times_and_counts_its_writes_and_leaves_the_stream_as_it_was():
    timeline, inner = HookTimeline(), SlowWriter()
    before = dict(vars(inner))
    stream = TimedWriteStream(inner, timeline)
    assert isinstance(stream, io.BufferedIOBase) and stream.writable()
    assert stream.write(b"abc") == 3 and stream.tell() == 3
    stream.flush()
    assert timeline.storage_clock.total_s() >= 0.01 and timeline.moved.total == 3
    assert set(vars(inner)) == set(before)  # nothing assigned on the client's stream
    stream.close()
    assert inner.closed and stream.closed


def test_a_write_stream_over_a_built_in_file(tmp_path):
    timeline = HookTimeline()
    with open(tmp_path / "f", "wb") as raw:
        stream = TimedWriteStream(raw, timeline)
        assert stream.write(b"abc") == 3 and stream.tell() == 3
        assert stream.fileno() == raw.fileno()
        stream.close()
    assert (tmp_path / "f").read_bytes() == b"abc"
    assert timeline.storage_clock.total_s() > 0 and timeline.moved.total == 3


def test_a_streams_own_error_is_noted_and_its_clock_stops():
    class Aborted(io.RawIOBase):
        def write(self, data) -> int:
            raise OSError("NoSuchUpload")

    timeline = HookTimeline()
    with pytest.raises(OSError):
        TimedWriteStream(Aborted(), timeline).write(b"x")
    assert timeline.stream_error == "OSError: NoSuchUpload"
    timeline.storage_clock.enter()  # not left inside a call: a new one opens and closes
    timeline.storage_clock.exit()
    assert timeline.moved.total == 0


def test_a_read_stream_counts_once_when_read_calls_its_own_readinto():
    timeline = HookTimeline()
    stream = TimedReadStream(Source(b"x" * 1000 + b"\nyz"), timeline)
    assert stream.readable() and stream.seekable()
    assert len(stream.read(600)) == 600
    assert stream.readinto(bytearray(300)) == 300
    assert stream.readline() == b"x" * 100 + b"\n"
    assert stream.seek(2, io.SEEK_CUR) == 1003 and stream.tell() == 1003
    assert stream.read() == b""
    assert timeline.moved.total == 1001


def test_the_timed_file_system_implements_torchs_interface_by_name():
    abstract = FileSystemBase.__abstractmethods__
    assert abstract and not TimedFileSystem.__abstractmethods__
    assert abstract <= set(vars(TimedFileSystem)), "each method of the interface is its own"


def test_a_timed_save_and_load_round_trip_and_count(tmp_path):
    weight = torch.arange(10_000, dtype=torch.float32)
    state: dict[str, Any] = {"weight": weight, "step": 3}
    save_timeline = HookTimeline()
    writer = TimedFileSystemWriter(str(tmp_path), timeline=save_timeline)
    assert isinstance(writer.fs, TimedFileSystem) and isinstance(writer.fs.inner, FileSystem)
    assert client_file_system(writer) is writer.fs.inner
    dcp.save(state, storage_writer=writer)
    assert save_timeline.moved.total >= 40_000 and save_timeline.storage_s is not None
    assert any(path.endswith(".metadata.tmp") for path in save_timeline.object_bytes)

    load_timeline = HookTimeline()
    loaded: dict[str, Any] = {"weight": torch.zeros(10_000), "step": 0}
    dcp.load(loaded, storage_reader=TimedFileSystemReader(str(tmp_path), timeline=load_timeline))
    assert torch.equal(loaded["weight"], weight) and loaded["step"] == 3
    assert load_timeline.io_bytes >= 40_000 and "read_metadata" in load_timeline.spans


def test_a_timed_writer_crosses_a_pickle(tmp_path):
    """The process checkpointer pickles the writer into its daemon."""
    timeline = HookTimeline()
    writer = pickle.loads(pickle.dumps(TimedFileSystemWriter(str(tmp_path), timeline=timeline)))
    assert isinstance(writer.fs, TimedFileSystem) and isinstance(writer.fs.inner, FileSystem)
    assert writer.fs.timeline is writer.timeline
    dcp.save({"weight": torch.ones(1000)}, storage_writer=writer)
    assert writer.timeline.moved.total >= 4000


def test_client_file_system_of_an_untimed_writer_is_its_own(tmp_path):
    writer = dcp.FileSystemWriter(str(tmp_path))
    assert client_file_system(writer) is writer.fs


UNPICKLED: list[str] = []


class _Trap:
    """A pickle that, once unpickled, says so: what a hostile .metadata would run."""

    def __reduce__(self):
        return (UNPICKLED.append, ("a swapped .metadata was unpickled",))


def test_dcp_unpickles_only_the_metadata_that_was_screened(tmp_path):
    """Issue 31: the launcher screened .metadata, then DCP read it again unscreened, so a
    file swapped in between was loaded (and unpickled). The timed reader now hands DCP's
    unpickler only bytes with the screened SHA-256."""
    import hashlib

    from dcp_fsdp.storage.metadata_peek import read_facts
    from dcp_fsdp.storage.timed_fs import expect_metadata, metadata_changed

    dcp.save({"weight": torch.ones(100)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    screened = (tmp_path / ".metadata").read_bytes()
    sha256 = read_facts(screened).sha256
    assert sha256 == hashlib.sha256(screened).hexdigest()
    reader = TimedFileSystemReader(str(tmp_path), timeline=HookTimeline())
    expect_metadata(reader, sha256)
    loaded = {"weight": torch.zeros(100)}
    dcp.load(loaded, storage_reader=reader)  # the screened file: loads
    assert torch.equal(loaded["weight"], torch.ones(100))
    assert reader.timeline.moved.total >= len(screened)  # its read timed and counted

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Trap()))  # swapped after the screen
    reader = TimedFileSystemReader(str(tmp_path), timeline=HookTimeline())
    expect_metadata(reader, sha256)
    with pytest.raises(dcp.CheckpointException, match="not the .metadata screened before the load"):
        dcp.load(loaded, storage_reader=reader)
    assert UNPICKLED == []
    assert "it was replaced since, and was not unpickled" in (metadata_changed(reader) or "")


class RemoteFileReader:  # named as multi-storage-client's ranged reader (above its switch)
    pass


class WholeFile:  # any other file: MSC downloaded the object whole
    pass


class MscFile(io.BytesIO):
    def __init__(self, data: bytes, kind: type) -> None:
        super().__init__(data)
        self._file = kind()


def test_an_msc_load_records_how_it_read_each_object():
    """Above its 512 MiB switch MSC reads by a ranged GET per read, below it downloads each
    object whole: the record says which (issue 47: its comparison ran below the switch)."""
    from dcp_fsdp.storage.timed_fs import DownloadingReadStream
    from dcp_fsdp.telemetry.time_split import MSC_READS, TimeSplit, split_line

    timeline = HookTimeline()
    for kind in (RemoteFileReader, WholeFile):
        stream = DownloadingReadStream(MscFile(b"x" * 64, kind), timeline)
        stream.seek(0)
        assert stream.read(8) == b"x" * 8
    assert timeline.msc_reads == {"ranged", "whole"}
    found = TimeSplit("load", 1.0, {"plan_s": 0.1, "storage_s": 0.9, "deserialise_s": 0.0,
                                    "target_copy_s": 0.0, "commit_s": 0.0},
                      {"storage": 0.9, "dcp": 0.1}, float("nan"), "storage", None, "ranged")
    assert MSC_READS["ranged"] in split_line(found)


def test_the_split_line_says_how_many_cores_the_operation_kept_busy():
    """cpu_s over duration_s, pooled over the samples that have it: a load whose time is in
    the storage client at 1 core busy was the client's own CPU work, not a wait."""
    from dcp_fsdp.telemetry.time_split import split_lines

    sample = {"op": "load", "plan_s": 0.1, "storage_s": 1.5, "deserialise_s": 0.3,
              "target_copy_s": 0.0, "commit_s": 0.1, "bytes": 1 << 20}
    samples = [{**sample, "duration_s": 2.0, "cpu_s": 2.0}, {**sample, "duration_s": 2.0,
                                                             "cpu_s": 1.0},
               {**sample, "duration_s": 2.0, "cpu_s": None}]
    (line,) = split_lines(samples)
    assert "; 0.75 cores busy" in line, line
    (line,) = split_lines([{**sample, "duration_s": 2.0}])
    assert "cores busy" not in line, line
