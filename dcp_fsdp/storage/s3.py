"""The S3 store: the writer and reader of one DCP client (`s3_clients.py`, by storage.client)
over one resolved target, and boto3 for the control plane (`s3_control.py`). It never writes
the environment: `environment()` says what a rank sets before building a writer or reader."""

from __future__ import annotations

import functools
import os
import secrets
from typing import Any

from dcp_fsdp.compat import installed_version
from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.storage.base import CheckpointStore, delegated
from dcp_fsdp.storage.layout import CLAIM_CONDITIONAL, CLAIM_NAME, CLAIM_NOT_ATOMIC, SuffixClaim, check_suffix
from dcp_fsdp.storage.raw import S3RawArea, s3_ceiling_prefix
from dcp_fsdp.storage.s3_control import S3ControlPlane
from dcp_fsdp.storage.s3_clients import (ConnectorClient, FsspecClient, MscClient, S3Client,
                                         connector_config, prefix_strategy)
from dcp_fsdp.storage.s3_target import S3Target

# storage.client's value -> its client (s3_clients.py): a new client is a class and a line here
CLIENTS: dict[str, type[S3Client]] = {client.name: client
                                      for client in (ConnectorClient, FsspecClient, MscClient)}


class S3Store(CheckpointStore):
    kind = "s3"

    def __init__(self, storage: StorageConfig, after_failure: bool = False) -> None:
        self.config = storage
        self.target = S3Target.from_config(storage)
        self.control = S3ControlPlane(self.target, storage.connect_timeout_s,
                                      storage.connect_timeout_s if after_failure else None)
        self.client = CLIENTS[storage.client](self.target, storage)

    def environment(self) -> dict[str, str]:
        found = {"AWS_ENDPOINT_URL": self.config.endpoint} if self.config.endpoint else {}
        return {**found, **self.client.environment()}

    def location(self, suffix: str) -> str:
        return f"{self.target.uri}/{suffix}"

    def describe(self) -> dict[str, Any]:
        target = self.target
        return {"kind": "s3", "uri": target.uri, "bucket": target.bucket, "region": target.region,
                "endpoint": target.endpoint, "force_path_style": target.force_path_style,
                "client": self.client.name, **self.client.retry(),
                "client_versions": {name: installed_version(name) for name in self.client.packages}}

    def preflight(self, writes: bool = True) -> None:
        self.control.preflight()  # HeadBucket: what a read needs, and a write's first check

    def claim(self, suffix: str, data: bytes) -> SuffixClaim:
        key = self.target.key(suffix, CLAIM_NAME)
        if self.control.honours_if_none_match():
            return SuffixClaim(self.control.put_if_absent(key, data), CLAIM_CONDITIONAL)
        self.control.put_key(key, data)  # the caller found no objects there just before
        return SuffixClaim(True, CLAIM_NOT_ATOMIC)

    def delete(self, suffix: str) -> None:
        check_suffix(suffix)  # never "" (the whole prefix) nor a path outside it
        self.control.delete_prefix(self.target.key(suffix) + "/")

    def probe(self) -> None:
        # beside the checkpoints (no '/' after the prefix: `list` never sees it)
        name = f"_dcp_fsdp.probe-{os.getpid()}-{secrets.token_hex(2)}"
        self.control.put_key(self.target.key(name), b"probe")
        self.control.delete_key(self.target.key(name))

    # -- raw objects (the raw ceiling), see raw.py --------------------------------------
    def data_object_prefix(self, rank: int) -> str:
        return prefix_strategy(self.config)(rank)

    def raw_area(self, token: str) -> S3RawArea:
        return S3RawArea(self.target.bucket, s3_ceiling_prefix(self.target.prefix, token), self.target.region,
                         functools.partial(connector_config, self.target, self.config))

    def clean_raw_area(self, token: str) -> int:
        prefix = s3_ceiling_prefix(self.target.prefix, token) + "/"
        aborted = self.control.abort_uploads_under(prefix)
        self.control.delete_prefix(prefix)
        return aborted

    # -- the client's (s3_clients.py) and the control plane's (s3_control.py) ------------
    close = delegated("client", S3Client.close)
    writer = delegated("client", S3Client.writer)
    reader = delegated("client", S3Client.reader)
    warm_up = delegated("client", S3Client.warm_up)
    list_checkpoints = delegated("control", S3ControlPlane.list_checkpoints)
    has_objects = delegated("control", S3ControlPlane.has_objects)
    object_sizes = delegated("control", S3ControlPlane.object_sizes)
    is_complete = delegated("control", S3ControlPlane.is_complete)
    put_small = delegated("control", S3ControlPlane.put_small)
    get_small = delegated("control", S3ControlPlane.get_small)
    open_uploads = delegated("control", S3ControlPlane.open_uploads)
    abort_uploads = delegated("control", S3ControlPlane.abort_uploads)
