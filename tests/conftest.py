"""Shared fixtures: a real SeaweedFS S3 server on loopback, one per test session."""

from __future__ import annotations

import uuid

import pytest

from dcp_fsdp.launch.embedded_s3 import EmbeddedS3, S3Endpoint


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS for the session (bucket `bench`), stopped at the end."""
    server = EmbeddedS3(bucket="bench")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server) -> S3Endpoint:
    return s3_server.endpoint


@pytest.fixture
def s3_uri(s3) -> str:
    """A fresh prefix in the session's bucket for one test."""
    return f"s3://{s3.bucket}/t-{uuid.uuid4().hex[:8]}"
