"""Count the control-plane calls our tool makes with boto3 (per attempt, with status).

They never pass through the connector's request log; a boto3 event hook records
each attempt as a `Request` of its own kind (HeadBucket, ListObjectsV2, ...).
"""

from __future__ import annotations

import time
from typing import Any, Callable


def install_control_plane_hook(record_call: Callable[[Any], None]) -> None:
    """Count every boto3 S3 attempt (per attempt, with its status) made in this process."""
    from dcp_fsdp.telemetry.request import Request

    try:
        import boto3
    except ImportError:
        return
    if boto3.DEFAULT_SESSION is None:
        boto3.setup_default_session()

    def on_attempt(event_name: str = "", response=None, caught_exception=None, **kwargs):
        operation = event_name.rsplit(".", 1)[-1]
        status = None
        if response is not None:
            try:
                status = int(response[0].status_code)
            except (AttributeError, IndexError, TypeError, ValueError):
                status = None
        outcome = ("ok" if status is not None and status < 400 else
                   "miss" if status == 404 and operation.startswith("Head") else "failed")
        record_call(Request(end_wall_s=time.time(), kind=operation, outcome=outcome,
                                        status=status, duration_s=None))
        return None  # never influences botocore's retry decision

    boto3.DEFAULT_SESSION.events.register("needs-retry.s3", on_attempt,
                                          unique_id="dcp-fsdp-control-plane-count")
