"""An object stream's own error reaches the failure line when DCP hides it (the trial's
case 20: an aborted multipart upload surfaced as torch's "enforce fail at
inline_container.cc ... unexpected pos")."""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsdp.errors import StorageStreamError
from dcp_fsdp.process.failures import root_cause
from dcp_fsdp.storage.timed_dcp import TimedFileSystemWriter
from dcp_fsdp.storage.timeline import HookTimeline

ABORTED = "NoSuchUpload: The specified multipart upload does not exist"


class _FailingStream:
    """A writable stream whose third write fails, as the connector's S3Writer does once
    its upload was aborted."""

    def __init__(self, stream) -> None:
        self._stream, self._writes = stream, 0

    def write(self, data) -> int:
        self._writes += 1
        if self._writes > 2:
            raise OSError(ABORTED)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _FailingFileSystem:
    def __init__(self, fs) -> None:
        self._fs = fs

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with self._fs.create_stream(path, mode) as stream:
            yield _FailingStream(stream) if str(path).endswith(".distcp") else stream

    def __getattr__(self, name):
        return getattr(self._fs, name)


def test_the_streams_error_is_the_cause_when_dcp_raises_another(tmp_path):
    writer = TimedFileSystemWriter(str(tmp_path), timeline=HookTimeline())
    writer.fs.inner = _FailingFileSystem(writer.fs.inner)  # under the timed streams, as the connector
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"weight": torch.ones(100_000)}, storage_writer=writer)
    # DCP's exceptions cross ranks pickled: only the message survives, no __context__
    error = pickle.loads(pickle.dumps(failed.value))
    line = root_cause(error)
    assert ABORTED in line and "unexpected pos" in line, line
    assert "rank 0: OSError: " + ABORTED in line, line
    assert line.startswith("its multipart upload was aborted by someone else"), line
    failure = next(iter(failed.value.failures.values()))
    inner = failure[0] if isinstance(failure, tuple) else failure  # (error, its traceback)
    assert isinstance(inner, StorageStreamError), inner


def test_a_write_after_its_upload_ended_says_what_ends_an_upload_under_a_save():
    """What the trial's case 20 showed on a 1.2 GiB save (re-checked on main): the CRT's
    "request has already completed" names no cause by itself."""
    crt = ("S3Exception: Client error: Unknown CRT error: CRT error 14366: aws-c-s3: "
           "AWS_ERROR_S3_REQUEST_HAS_COMPLETED, Request has already completed, action cannot "
           "be performed.")
    line = root_cause(StorageStreamError(f"{crt} (then DCP: RuntimeError: unexpected pos)"))
    assert "its multipart upload aborted under it (dcp-fsdp clean-uploads --force" in line
    assert "clean-uploads --min-age-s" in line and "CRT error 14366" in line
