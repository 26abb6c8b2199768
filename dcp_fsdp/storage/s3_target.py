"""Where an S3 store's checkpoints go: the settings and the AWS environment, resolved once
(shared by the data plane, `s3.py`, and the control plane, `s3_control.py`)."""

from __future__ import annotations

import dataclasses
import os

from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.config.validate import parse_s3_uri


def resolve_region(storage: StorageConfig) -> str:
    return (storage.region or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")


def resolve_endpoint(storage: StorageConfig) -> str | None:
    return storage.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL") or None


@dataclasses.dataclass(frozen=True)
class S3Target:
    """Where the checkpoints go, resolved from the settings and the AWS environment."""

    uri: str  # s3://bucket/prefix, no trailing slash
    bucket: str
    prefix: str
    region: str
    endpoint: str | None
    force_path_style: bool

    @classmethod
    def from_config(cls, storage: StorageConfig) -> "S3Target":
        assert storage.uri is not None
        bucket, prefix = parse_s3_uri(storage.uri)
        endpoint = resolve_endpoint(storage)
        return cls(uri=storage.uri.rstrip("/"), bucket=bucket, prefix=prefix,
                   region=resolve_region(storage), endpoint=endpoint,
                   force_path_style=(storage.force_path_style
                                     if storage.force_path_style is not None
                                     else endpoint is not None))

    def key(self, suffix: str, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, suffix, name) if p)
