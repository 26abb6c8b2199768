"""The request counts' hook on the control plane's boto3 clients (storage/s3_control.py
observe_clients, telemetry/control_plane.py count_control_calls): each client the control
plane creates is handed to the observers once, and its attempts are counted per attempt with
their status. A client is created offline (no request is sent here); an attempt is botocore's
own `needs-retry` event, emitted on the client's emitter as botocore emits it."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest

from dcp_fsdp.storage import s3_control
from dcp_fsdp.storage.s3_control import S3ControlPlane, observe_clients
from dcp_fsdp.storage.s3_target import S3Target
from dcp_fsdp.telemetry.control_plane import count_control_calls
from dcp_fsdp.telemetry.request import Request

TARGET = S3Target(uri="s3://bench/x", bucket="bench", prefix="x", region="us-east-1",
                  endpoint="http://127.0.0.1:9", force_path_style=True)


def _attempt(events: Any, operation: str, status: int | None) -> None:
    response: tuple[Any, dict] | None = (None if status is None
                                         else (SimpleNamespace(status_code=status), {}))
    events.emit(f"needs-retry.s3.{operation}", response=response, endpoint=None,
                operation=None, attempts=1, caught_exception=None, request_dict={})


def test_each_control_plane_client_is_handed_to_the_observers_once(monkeypatch):
    monkeypatch.setattr(s3_control, "_client_observers", {})
    seen: list[Any] = []
    observe_clients("test", seen.append)
    control = S3ControlPlane(TARGET, connect_timeout_s=1)
    client = control.client()
    assert control.client() is client  # made once, observed once
    assert seen == [client.meta.events]


def test_attempts_are_counted_per_attempt_with_their_status():
    from botocore.hooks import HierarchicalEmitter

    events = HierarchicalEmitter()
    calls: list[Request] = []
    count_control_calls(events, calls.append)
    count_control_calls(events, calls.append)  # registered once per emitter
    _attempt(events, "HeadObject", 404)
    _attempt(events, "PutObject", 200)
    _attempt(events, "ListObjectsV2", None)  # no answer (a reset)
    _attempt(events, "GetObject", 503)
    assert [(c.kind, c.outcome, c.status) for c in calls] == [
        ("HeadObject", "miss", 404), ("PutObject", "ok", 200), ("ListObjectsV2", "failed", None),
        ("GetObject", "failed", 503)]


def test_a_later_observer_of_the_same_key_replaces_the_first(monkeypatch):
    monkeypatch.setattr(s3_control, "_client_observers", {})
    first: list[Any] = []
    second: list[Any] = []
    observe_clients("counts", first.append)
    observe_clients("counts", second.append)
    S3ControlPlane(TARGET, connect_timeout_s=1).client()
    assert first == [] and len(second) == 1


def test_a_client_made_before_the_observer_is_not_handed_to_it(monkeypatch):
    """As botocore itself: a client takes its hooks when it is created."""
    monkeypatch.setattr(s3_control, "_client_observers", {})
    control = S3ControlPlane(TARGET, connect_timeout_s=1)
    control.client()
    seen: list[Any] = []
    observe_clients("test", seen.append)
    control.client()
    assert seen == []


@pytest.mark.parametrize("mode", ("legacy", "standard"))
@pytest.mark.parametrize("hook", ("control", "data"))
def test_every_attempt_sent_is_counted_in_either_retry_mode(mode, hook):
    """botocore's legacy retry handler raises the last attempt's error from inside the
    `needs-retry` event: a hook registered after it never saw that attempt (a failed save under
    legacy mode counted 4 DeleteObjects and 8 UploadParts of 5 and 10). A refused connection
    (a bound port nobody listens on): every attempt botocore sends is one counted."""
    import boto3
    import botocore.config

    from dcp_fsdp.telemetry.control_plane import install_data_plane_hook

    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{refusing.getsockname()[1]}",
                          region_name="us-east-1", aws_access_key_id="key",
                          aws_secret_access_key="secret",
                          config=botocore.config.Config(retries={"mode": mode, "total_max_attempts": 2}))
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    calls: list[Request] = []
    (count_control_calls if hook == "control" else install_data_plane_hook)(client.meta.events,
                                                                          calls.append)
    try:
        with pytest.raises(Exception, match="Could not connect to the endpoint URL"):
            client.delete_objects(Bucket="b", Delete={"Objects": [{"Key": "k"}]})
    finally:
        refusing.close()
    assert len(sent) == 2, sent
    assert [(c.kind, c.outcome) for c in calls] == [("DeleteObjects", "failed")] * 2
