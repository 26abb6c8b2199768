"""A failed save or load, as one line: the root cause, the ranks it hit, and the fix."""

from __future__ import annotations

import dataclasses
import re
import threading
# store: a CheckpointStore or None (storage is a layer above this one: not imported)
from typing import Any, Callable

from dcp_fsdp.errors import BenchmarkFailure, StorageStreamError, UserError
from dcp_fsdp.process.signals import Terminated


# The line's form for S3 errors, the first that matches: one whose cause lies outside the run is
# named first (the line then says what S3 said); the connector's errors once its CRT client has
# used up storage.max_attempts are followed by the fix.
_S3_FORMS = (
    (("NoSuchUpload",),
     "its multipart upload was aborted by someone else (dcp-fsdp clean-uploads --force, or a "
     "bucket lifecycle rule) while it ran; abort only uploads older than any save "
     "(clean-uploads --min-age-s), never those of a running save: {line}"),
    (("Request throttled",),
     "{line} (S3 throttled every attempt (HTTP 503 SlowDown): retries exhausted; raise "
     "storage.max_attempts or lower the request rate, e.g. fewer ranks or threads)"),
    (("AWS_IO_SOCKET_CLOSED", "AWS_ERROR_HTTP_CONNECTION_CLOSED", "AWS_IO_SOCKET_TIMEOUT",
      "AWS_IO_SOCKET_CONNECTION_REFUSED"),
     "{line} (the connection to S3 failed on every attempt: retries exhausted; check the "
     "endpoint and the network, or raise storage.max_attempts)"),
    # what a write meets once the upload it feeds ended with an error
    (("AWS_ERROR_S3_REQUEST_HAS_COMPLETED",),
     "{line} (the object's upload had already ended with an error: its parts failed (the server "
     "answered an error, or S3 was unreachable; keep_request_log=true keeps each rank's requests) "
     "or its multipart upload aborted under it (dcp-fsdp clean-uploads --force, a bucket "
     "lifecycle rule); abort only uploads older than any save (clean-uploads --min-age-s))"),
)


@dataclasses.dataclass(frozen=True)
class ErrorAnswers:
    """The first HTTP error answer among a failed operation's requests (the request log's), and
    how many attempts of its kind got that status: a client's own error can hide it (the
    connector's write on an upload its failed parts had ended says only that it had ended)."""

    rank: int
    kind: str  # S3's request name: UploadPart, GetObject, ...
    status: int
    answered: int  # attempts of `kind` answered `status`
    attempts: int  # attempts of `kind` in all

    def lead(self) -> str:
        share = (f"all {self.attempts}" if self.answered == self.attempts
                 else f"{self.answered} of {self.attempts}")
        return (f"S3 answered HTTP {self.status} to {share} of rank {self.rank}'s {self.kind} "
                f"attempts{_STATUS_FIXES.get(self.status // 100 * 100, '')}")


class AnsweredError(StorageStreamError):
    """A rank's failed write or read with the server's error answers its own request log saw:
    pickled whole into DCP's CheckpointException (which keeps no exception's cause), so the
    rank that says the line can lead it with another rank's answers."""

    def __init__(self, text: str, answers: ErrorAnswers) -> None:
        super().__init__(text, answers)
        self.answers = answers

    def __str__(self) -> str:
        return str(self.args[0])


# Where this process's error answers come from (the rank's request log, once it is open); None:
# none known (the process checkpointer's daemon, request_stats=false).
_answers_source: Callable[[], ErrorAnswers | None] | None = None


def answers_from(source: Callable[[], ErrorAnswers | None] | None) -> None:
    """Name (or, with None, forget) where `answered()` finds this process's error answers."""
    global _answers_source
    _answers_source = source


def answered(error: BaseException) -> AnsweredError | None:
    """`error` (a failed write_data or read_data) with the server's error answers among this
    process's requests; None where it answered no error or none is known."""
    try:
        answers = _answers_source() if _answers_source is not None else None
    except Exception:  # an unreadable request log never hides the error it would have led
        return None
    if answers is None or isinstance(error, AnsweredError):
        return None
    return AnsweredError(innermost(error), answers)


_STATUS_FIXES = {500: " (the server failed them: check its health, its logs and its free space)"}
# The forms whose line already names the first cause: an ErrorAnswers does not lead them.
_NAMED_CAUSES = ("NoSuchUpload", "Request throttled", "AWS_IO_SOCKET_CLOSED",
                 "AWS_ERROR_HTTP_CONNECTION_CLOSED", "AWS_IO_SOCKET_TIMEOUT",
                 "AWS_IO_SOCKET_CONNECTION_REFUSED")


def root_cause(error: BaseException, answers: ErrorAnswers | None = None) -> str:
    """One line: for DCP's CheckpointException, the failing ranks and their innermost errors
    (ranks with the same error named together), plus a hint for S3 retries exhausted; led by
    `answers` (the server's error answers) unless the error names its cause itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        ranks_by_text: dict[str, list[int]] = {}
        for rank, wrapped in sorted(error.failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            ranks_by_text.setdefault(innermost(exc), []).append(rank)
            if answers is None and isinstance(exc, AnsweredError):
                answers = exc.answers  # the lowest failing rank's that the server answered
        parts = [f"{_ranks(ranks)}: {text}" for text, ranks in ranks_by_text.items()]
        line = "; ".join(parts[:2]) + (f" (+{len(parts) - 2} more errors)" if len(parts) > 2 else "")
    else:
        line = innermost(error)
    if answers is not None and not any(needle in line for needle in _NAMED_CAUSES):
        return f"{answers.lead()}; then {line}"
    form = next((form for needles, form in _S3_FORMS if any(n in line for n in needles)), "{line}")
    return form.format(line=line)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(rank) for rank in ranks[:4])
    return f"ranks {shown}" + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def innermost(error: BaseException) -> str:
    """The innermost cause of `error`, as one line of at most about 400 characters."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = _s3_answer(" ".join(str(error).split())) or repr(error)
    if isinstance(error, StorageStreamError):  # its text names the stream's own error
        return text[:400]
    return f"{type(error).__name__}: {text[:400]}"


# The connector's text of an error answer: "Client error: Unknown response error:
# MetaRequestResult { response_status: 404, ... <Code>NoSuchUpload</Code><Message>...}"
_S3_RESULT = re.compile(r"Client error: Unknown response error: MetaRequestResult \{ "
                        r"response_status: (\d+).*?<Code>([^<]*)</Code>"
                        r"(?:\s*<Message>([^<]*)</Message>)?.*?\}\s*")


def _s3_answer(text: str) -> str:
    """The connector's verbose error answer as S3 gave it ("S3 answered HTTP 404 NoSuchUpload:
    ..."), whose code and message were past the 400 characters a line keeps."""
    def said(found: re.Match) -> str:
        message = f": {found.group(3).strip()}" if found.group(3) else ""
        return f"S3 answered HTTP {found.group(1)} {found.group(2)}{message} "
    return _S3_RESULT.sub(said, text).strip()


def collective_error(error: BaseException) -> bool:
    """Errors every rank raises together (only rank 0 needs to print them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(error, (UserError, BenchmarkFailure, CheckpointException))


def caused_by_interrupt(error: BaseException) -> bool:
    """KeyboardInterrupt / Terminated, possibly wrapped by DCP on some rank."""
    if isinstance(error, (KeyboardInterrupt, Terminated)):
        return True
    failures = getattr(error, "failures", None)  # DCP's CheckpointException
    if isinstance(failures, dict):
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException) and caused_by_interrupt(inner):
                return True
    cause = error.__cause__ or error.__context__
    return cause is not None and cause is not error and caused_by_interrupt(cause)


# A failing rank's wait for its probe's answer: well inside a finishing rank's time after
# the agent's SIGTERM (signals.py), so an endpoint that hangs cannot cost it its record.
PROBE_DEADLINE_S = 5.0


def says_the_line(error: BaseException, is_coordinator: bool, joined: bool = True) -> bool:
    """Whether this rank prints a failure's line and probes the storage for it: the coordinator
    for an error every rank raises together (collective_error), else the rank itself (one probe)."""
    return not joined or not collective_error(error) or is_coordinator


def failure_line(store: Any, error: BaseException, probe: bool,
                 error_answers: ErrorAnswers | None = None) -> str:
    """A failed operation's line (root_cause), led by what the storage says when `probe`d once
    afterwards: a full file system or an endpoint that stopped answering is the first cause,
    which DCP's own error hides."""
    error_line = root_cause(error, error_answers)
    if not probe or store is None:
        return error_line
    answers: list[BaseException | None] = []

    def ask() -> None:
        try:
            store.probe()
            answers.append(None)
        except Exception as problem:
            answers.append(problem)

    prober = threading.Thread(target=ask, daemon=True, name="dcp-fsdp-failure-probe")
    prober.start()
    prober.join(PROBE_DEADLINE_S)
    if not answers:
        return (f"the storage did not answer a probe within {PROBE_DEADLINE_S:g} s after the failure "
                f"({error_line})")
    problem = answers[0]
    if problem is None:
        return error_line
    if isinstance(problem, UserError):
        return f"{problem} (found by probing the storage after the failure: {error_line})"
    # the store's client raised something it does not explain
    text = " ".join(str(problem).split())[:300]
    return (f"the storage failed a probe after the failure: {type(problem).__name__}: {text} "
            f"({error_line})")
