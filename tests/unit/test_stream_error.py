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
from dcp_fsdp.process.failures import AnsweredError, ErrorAnswers, answered, answers_from, root_cause
from dcp_fsdp.storage.timed_dcp import TimedFileSystemWriter
from dcp_fsdp.storage.timeline import HookTimeline

ABORTED = "NoSuchUpload: The specified multipart upload does not exist"
COMPLETED = ("S3Exception: Client error: Unknown CRT error: CRT error 14366: aws-c-s3: "
             "AWS_ERROR_S3_REQUEST_HAS_COMPLETED, Request has already completed")


class _FailingStream:
    """A writable stream whose third write fails, as the connector's S3Writer does once
    its upload was aborted."""

    def __init__(self, stream, message: str = ABORTED) -> None:
        self._stream, self._writes, self._message = stream, 0, message

    def write(self, data) -> int:
        self._writes += 1
        if self._writes > 2:
            raise OSError(self._message)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _FailingFileSystem:
    def __init__(self, fs, message: str = ABORTED) -> None:
        self._fs, self._message = fs, message

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with self._fs.create_stream(path, mode) as stream:
            yield (_FailingStream(stream, self._message) if str(path).endswith(".distcp")
                   else stream)

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


def test_the_servers_error_answers_lead_a_line_that_does_not_name_its_cause():
    """The same write, and the rank's request log saw every UploadPart answered 500: that is
    the first cause, not an upload aborted under the save."""
    crt = ("S3Exception: Client error: Unknown CRT error: CRT error 14366: aws-c-s3: "
           "AWS_ERROR_S3_REQUEST_HAS_COMPLETED, Request has already completed, action cannot "
           "be performed.")
    answers = ErrorAnswers(rank=3, kind="UploadPart", status=500, answered=101, attempts=101)
    line = root_cause(StorageStreamError(crt), answers)
    assert line.startswith("S3 answered HTTP 500 to all 101 of rank 3's UploadPart attempts "
                           "(the server failed them: check its health"), line
    assert line.endswith(f"; then {crt}") and "aborted under it" not in line, line
    some = ErrorAnswers(rank=0, kind="GetObject", status=403, answered=2, attempts=5)
    assert root_cause(StorageStreamError("OSError: denied"), some) == (
        "S3 answered HTTP 403 to 2 of 5 of rank 0's GetObject attempts; then OSError: denied")


def test_a_line_that_names_its_cause_is_not_led_by_the_answers():
    """Throttling (503 SlowDown) and an aborted upload are named by the line's own form."""
    answers = ErrorAnswers(rank=0, kind="UploadPart", status=503, answered=4, attempts=4)
    line = root_cause(StorageStreamError("S3Exception: Request throttled"), answers)
    assert line.startswith("S3Exception: Request throttled (S3 throttled every attempt"), line
    line = root_cause(StorageStreamError(f"OSError: {ABORTED}"), answers)
    assert line.startswith("its multipart upload was aborted by someone else"), line


@pytest.fixture
def answers_known():
    """This process's request log, as a rank names it: every UploadPart answered 500."""
    answers = ErrorAnswers(rank=1, kind="UploadPart", status=500, answered=101, attempts=101)
    answers_from(lambda: answers)
    yield answers
    answers_from(None)


def test_a_ranks_failed_write_carries_its_answers_to_the_rank_that_says_the_line(tmp_path,
                                                                                answers_known):
    """Another rank's refused writes: its write_data raises its error with the answers its own
    request log saw, which cross ranks pickled inside DCP's CheckpointException, so rank 0's
    line (whose own log saw none of them) leads with rank 1's count."""
    writer = TimedFileSystemWriter(str(tmp_path), timeline=HookTimeline())
    writer.fs.inner = _FailingFileSystem(writer.fs.inner, COMPLETED)
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"weight": torch.ones(100_000)}, storage_writer=writer)
    error = pickle.loads(pickle.dumps(failed.value))
    inner = next(iter(error.failures.values()))
    inner = inner[0] if isinstance(inner, tuple) else inner
    assert isinstance(inner, AnsweredError) and inner.answers == answers_known
    line = root_cause(error)  # rank 0's: no answers of its own
    assert line.startswith("S3 answered HTTP 500 to all 101 of rank 1's UploadPart attempts"), line
    assert COMPLETED in line and "unexpected pos" in line, line  # the stream's error, then DCP's
    assert "aborted under it" not in line, line  # the hint's guess: the answers name the cause
    own = ErrorAnswers(rank=0, kind="UploadPart", status=502, answered=1, attempts=9)
    assert root_cause(error, own).startswith("S3 answered HTTP 502 to 1 of 9 of rank 0's")


def test_a_ranks_failed_read_carries_its_answers(tmp_path, answers_known):
    """A load whose read failed: the same, through the timed reader."""
    from dcp_fsdp.storage.timed_dcp import TimedFileSystemReader

    dcp.save({"weight": torch.ones(1000)}, storage_writer=TimedFileSystemWriter(
        str(tmp_path), timeline=HookTimeline()))
    for data in tmp_path.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])  # cut short: torch cannot parse it
    with pytest.raises(CheckpointException) as failed:
        dcp.load({"weight": torch.zeros(1000)},
                 storage_reader=TimedFileSystemReader(str(tmp_path), timeline=HookTimeline()))
    error = pickle.loads(pickle.dumps(failed.value))
    assert root_cause(error).startswith("S3 answered HTTP 500 to all 101 of rank 1's"), root_cause(error)


def test_no_answers_known_leaves_the_error_as_it_was():
    """request_stats=false, or the process checkpointer's daemon: nothing names the answers."""
    answers_from(None)
    assert answered(OSError("x")) is None
    known = ErrorAnswers(rank=0, kind="GetObject", status=500, answered=1, attempts=1)
    answers_from(lambda: None)
    try:
        assert answered(OSError("x")) is None

        def unreadable() -> ErrorAnswers | None:
            raise OSError("the request log is gone")
        answers_from(unreadable)
        assert answered(OSError("x")) is None  # the error itself is raised, not the log's
        answers_from(lambda: None)
        carried = AnsweredError("OSError: x", known)
        assert answered(carried) is None  # carried once
        again = pickle.loads(pickle.dumps(carried))
        assert (str(again), again.answers) == ("OSError: x", known)
    finally:
        answers_from(None)
