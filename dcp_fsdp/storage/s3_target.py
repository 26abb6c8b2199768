"""Where an S3 store's checkpoints go: the settings and the AWS environment, resolved once
(shared by the data plane, `s3.py`, and the control plane, `s3_control.py`)."""

from __future__ import annotations

import dataclasses
import os

from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.config.validate import parse_s3_uri
from dcp_fsdp.errors import UserError


def endpoint_source(storage: StorageConfig) -> str:
    """The setting or variable the endpoint comes from: what an error message names."""
    variables = () if storage.endpoint else ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    return next((name for name in variables if os.environ.get(name)), "storage.endpoint")


def resolve_endpoint(storage: StorageConfig) -> str | None:
    source = endpoint_source(storage)
    return (storage.endpoint if source == "storage.endpoint" else os.environ[source]) or None


@dataclasses.dataclass(frozen=True)
class S3Target:
    """Where the checkpoints go, resolved from the settings and the AWS environment."""

    uri: str  # s3://bucket/prefix, no trailing slash
    bucket: str
    prefix: str
    region: str
    endpoint: str | None
    force_path_style: bool
    endpoint_source: str = "storage.endpoint"  # what error messages name

    @classmethod
    def from_config(cls, storage: StorageConfig) -> "S3Target":
        endpoint, source = resolve_endpoint(storage), endpoint_source(storage)
        if storage.uri is None:
            # Only the embedded server fills it in; with an endpoint set there is none.
            raise UserError(f"storage.uri is not set but {source}={endpoint} "
                            "is: give the bucket too, e.g. storage.uri=s3://my-bucket/checkpoints"
                            + ("" if storage.endpoint else f" (or unset {source} for the embedded server)"))
        bucket, prefix = parse_s3_uri(storage.uri)
        return cls(uri=storage.uri.rstrip("/"), bucket=bucket, prefix=prefix, endpoint=endpoint,
                   region=(storage.region or os.environ.get("AWS_REGION")
                           or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"),
                   force_path_style=(storage.force_path_style
                                     if storage.force_path_style is not None
                                     else endpoint is not None),
                   endpoint_source=source)

    def key(self, suffix: str, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, suffix, name) if p)


def botocore_retry(mode: str | None = None, default: str = "legacy") -> dict[str, object]:
    """The retry mode and most attempts of a botocore client built now: `mode` where the client
    fixes it, else AWS_RETRY_MODE or the profile's, else `default` (botocore's: legacy);
    AWS_MAX_ATTEMPTS or the profile's, else the mode's default (legacy 5, standard and adaptive 3)."""
    import botocore.session

    # botocore's own chain for retry_mode (AWS_RETRY_MODE, then the profile), `default` last
    session = botocore.session.Session(
        session_vars={"retry_mode": ("retry_mode", "AWS_RETRY_MODE", default, None)})
    mode = mode or session.get_config_variable("retry_mode")
    attempts = session.get_config_variable("max_attempts") or (5 if mode == "legacy" else 3)
    return {"retry_mode": mode, "max_attempts": int(attempts)}
