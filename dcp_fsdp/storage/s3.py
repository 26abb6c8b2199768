"""The S3 store: s3torchconnector's DCP writer and reader (data plane), over one
resolved target, with boto3 for the control plane (`s3_control.py`).

The connector's native (CRT) client takes no endpoint argument: it reads
AWS_ENDPOINT_URL. `connector_environment()` says what the rank must set before it
builds a writer or reader; this module never writes the environment itself.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from dcp_fsdp.config.schema import MIB, PrefixStrategy, ReaderKind, StorageConfig
from dcp_fsdp.config.validate import parse_s3_uri
from dcp_fsdp.storage.layout import CheckpointInfo
from dcp_fsdp.storage.s3_control import S3ControlPlane


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


class S3Store:
    kind = "s3"

    def __init__(self, storage: StorageConfig) -> None:
        self.config = storage
        self.target = S3Target.from_config(storage)
        self.control = S3ControlPlane(self.target, storage.connect_timeout_s)
        # kept as attributes: tests and the run record read them
        self.uri, self.bucket, self.prefix = self.target.uri, self.target.bucket, self.target.prefix
        self.region, self.endpoint = self.target.region, self.target.endpoint
        self.force_path_style = self.target.force_path_style

    def connector_environment(self) -> dict[str, str]:
        """Variables the CRT client must see (set them before building a writer/reader)."""
        return {"AWS_ENDPOINT_URL": self.config.endpoint} if self.config.endpoint else {}

    # -- locations -------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        return f"{self.uri}/{suffix}"

    def describe(self) -> dict[str, Any]:
        return {"kind": "s3", "uri": self.uri, "bucket": self.bucket, "region": self.region,
                "endpoint": self.endpoint, "force_path_style": self.force_path_style}

    # -- DCP writer / reader -----------------------------------------------------------
    def _client_config(self):
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(
            throughput_target_gbps=self.config.throughput_target_gbps,
            part_size=self.config.part_size_mib * MIB,
            force_path_style=self.force_path_style,
            max_attempts=self.config.max_attempts,
        )

    def _prefix_strategy(self):
        from s3torchconnector import dcp as s3dcp
        from s3torchconnector.dcp.s3_prefix_strategy import RoundRobinPrefixStrategy

        strategy = self.config.prefix_strategy
        if strategy == PrefixStrategy.default:
            return s3dcp.DefaultPrefixStrategy()
        if strategy == PrefixStrategy.binary:
            return s3dcp.BinaryPrefixStrategy(prefix_count=self.config.prefix_count)
        if strategy == PrefixStrategy.hex:
            return s3dcp.HexPrefixStrategy(prefix_count=self.config.prefix_count)
        return RoundRobinPrefixStrategy(list(self.config.round_robin_prefixes))

    def writer(self, suffix: str):
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(
            region=self.region, path=self.location(suffix), s3client_config=self._client_config(),
            prefix_strategy=self._prefix_strategy(), thread_count=self.config.thread_count,
            overwrite=False,
        )

    def warm_up(self, storage_io) -> None:
        """Build the connector's native (CRT) client now, outside the timed region.

        s3torchconnector creates it lazily on the first request; the first
        save of a process otherwise pays ~1 s of client set-up (credential chain,
        event loop, thread pools) inside the timer. Connections are not opened here:
        those are part of the I/O a checkpoint really pays.
        """
        client = getattr(getattr(storage_io, "fs", None), "_client", None)
        if client is not None and hasattr(client, "_client"):
            client._client  # noqa: B018 - property access builds the client

    def reader(self, suffix: str):
        from s3torchconnector import S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader

        if self.config.reader == ReaderKind.dcp_optimized:
            constructor = S3ReaderConstructor.dcp_optimized(
                max_gap_size=int(self.config.max_gap_size_mib * MIB))
        else:
            constructor = {
                ReaderKind.sequential: S3ReaderConstructor.sequential,
                ReaderKind.range_based: S3ReaderConstructor.range_based,
            }[self.config.reader]()
        return S3StorageReader(region=self.region, path=self.location(suffix),
                               s3client_config=self._client_config(),
                               reader_constructor=constructor)

    # -- control plane (boto3), see s3_control.py ---------------------------------------
    def preflight(self) -> None:
        self.control.preflight()

    def list_checkpoints(self) -> list[CheckpointInfo]:
        return self.control.list_checkpoints()

    def has_objects(self, suffix: str) -> bool:
        return self.control.has_objects(suffix)

    def is_complete(self, suffix: str) -> bool:
        return self.control.is_complete(suffix)

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        self.control.put_small(suffix, name, data)

    def get_small(self, suffix: str, name: str) -> bytes | None:
        return self.control.get_small(suffix, name)

    def delete_checkpoint(self, suffix: str) -> None:
        self.control.delete_checkpoint(suffix)

    def boto_client(self):
        return self.control.client()
