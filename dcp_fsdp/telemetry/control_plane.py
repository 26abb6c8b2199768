"""Count the S3 calls our tool makes with boto3 (per attempt, with status): the control
plane's, which never pass through the connector's log, and the data plane's of the
botocore-based clients (install_data_plane_hook), each attempt a `Request`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from dcp_fsdp.telemetry.request import Request


def count_control_calls(events: Any, record_call: Callable[[Any], None]) -> None:
    """Count every S3 attempt of the boto3 client whose event emitter is `events` (per
    attempt, with its status): the control plane's clients (storage/s3_control.py
    observe_clients hands over each one's)."""
    def on_attempt(event_name: str = "", response: Any = None, **kwargs: Any) -> None:
        operation = event_name.rsplit(".", 1)[-1]
        status = _attempt_status(response)
        record_call(Request(end_wall_s=time.time(), kind=operation,
                            outcome=_outcome(status, operation), status=status, duration_s=None))
        return None  # never influences botocore's retry decision

    events.register_first("needs-retry.s3", on_attempt, unique_id="dcp-fsdp-control-plane-count")


_STARTED = "dcp_fsdp_attempt_started"  # in botocore's per-request context
_SENT = "dcp_fsdp_upload_body_bytes"  # ... and an upload attempt's body length
UPLOADS = ("PutObject", "UploadPart")  # the requests whose bodies are object bytes
_PREVIOUS = "dcp_fsdp_previous_attempt"
_GET = "dcp_fsdp_get_target"  # a GetObject attempt's (URL, Range): a re-sent GET has the same
_RETRYABLE_STATUSES = (408, 429, 500, 502, 503, 504)


def _attempt_status(response: Any) -> int | None:
    try:
        return int(response[0].status_code)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _outcome(status: int | None, operation: str) -> str:
    return ("ok" if status is not None and status < 400 else
            "miss" if status == 404 and operation.startswith("Head") else "failed")


def _body_bytes(response: Any, operation: str) -> int | None:
    """A GetObject attempt's body length, from its Content-Length."""
    if operation != "GetObject":
        return None
    try:
        return int(response[0].headers["content-length"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _upload_body_bytes(request: Any, event_name: str) -> int | None:
    """A PutObject or UploadPart attempt's body length, as botocore measures it for its
    Content-Length; None for other requests or a body of unknown length."""
    if event_name.rsplit(".", 1)[-1] not in UPLOADS:
        return None
    from botocore.utils import determine_content_length

    try:
        length = determine_content_length(getattr(request, "body", None))
    except Exception:  # a body botocore cannot measure either: unknown, never fatal
        return None
    return None if length is None else int(length)


def install_data_plane_hook(events: Any, record_call: Callable[[Any], None]) -> None:
    """Record every S3 attempt of a botocore or aiobotocore client (s3fs, MSC) as the
    connector's log lines are recorded: an attempt followed by another of the same call is
    `retried`; a GET whose body breaks mid-stream is marked by its body (get_bodies.py), and
    retried when the client sends the same GET again. Registered once per emitter."""
    broken_gets = _BrokenGets()

    def on_request_created(request: Any = None, event_name: str = "", **kwargs: Any) -> None:
        context = getattr(request, "context", None)
        if context is None:
            return
        previous = context.get(_PREVIOUS)
        if previous is not None:
            previous.retried = True  # botocore is sending this call again
        if event_name.endswith(".GetObject"):
            target = (str(getattr(request, "url", "")),
                      str((getattr(request, "headers", None) or {}).get("Range", "")))
            context[_GET] = target
            broken_gets.sent_again(target)
        context[_STARTED] = time.time()
        context[_SENT] = _upload_body_bytes(request, event_name)

    def on_get_answered(http_response: Any = None, parsed: Any = None, context: Any = None,
                        **kwargs: Any) -> None:
        call = (context or {}).get(_PREVIOUS)
        if call is None or call.outcome != "ok" or not isinstance(parsed, dict) \
                or "Body" not in parsed:
            return
        from dcp_fsdp.telemetry.get_bodies import (BodyCount, aiohttp_body_bytes, counted_body,
                                                    note_response_socket)

        note_response_socket(http_response)
        target = context.get(_GET)
        count = BodyCount(call, lambda broken: broken_gets.add(target, broken),
                          aiohttp_body_bytes(http_response))
        parsed["Body"] = counted_body(parsed["Body"], count)

    def on_attempt(event_name: str = "", response: Any = None, request_dict: Any = None,
                   **kwargs: Any) -> None:
        operation = event_name.rsplit(".", 1)[-1]
        context = (request_dict or {}).get("context", {})
        started, ended = context.get(_STARTED), time.time()
        status = _attempt_status(response)
        outcome = _outcome(status, operation)
        call = Request(end_wall_s=ended, kind=operation, outcome=outcome, status=status,
                       duration_s=None if started is None else ended - started,
                       nbytes=(context.get(_SENT) if operation in UPLOADS
                               else _body_bytes(response, operation)),
                       retryable=outcome == "failed" and (status is None
                                                          or status in _RETRYABLE_STATUSES),
                       opened_wall_s=started)
        context[_PREVIOUS] = call
        record_call(call)
        return None  # never influences botocore's retry decision

    events.register("request-created.s3", on_request_created,
                    unique_id="dcp-fsdp-data-plane-started")
    # first: botocore's legacy retry handler raises the last attempt's error from inside this
    # event, and a handler registered after it never saw that attempt (5 of 6 counted)
    events.register_first("needs-retry.s3", on_attempt, unique_id="dcp-fsdp-data-plane-count")
    events.register("after-call.s3.GetObject", on_get_answered,
                    unique_id="dcp-fsdp-data-plane-get-body")


class _BrokenGets:
    """GETs whose body broke, by (URL, Range), until the client sends the same GET again
    (s3fs, MSC and s3transfer re-send it whole): then it was retried."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def add(self, target: tuple[str, str] | None, call: Any) -> None:
        if target is not None:
            with self._lock:
                self._waiting[target] = call

    def sent_again(self, target: tuple[str, str]) -> None:
        with self._lock:
            call = self._waiting.pop(target, None)
        if call is not None:
            call.retried = True
