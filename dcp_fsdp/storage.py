"""Storage backends: where checkpoints go, and the DCP writer/reader for each.

`make_backend(cfg.storage)` returns an `S3Backend` (s3torchconnector) or an
`FsBackend` (DCP's own FileSystemWriter, the baseline). Both lay checkpoints
out as `<root>/<suffix>/`, and a checkpoint is complete when its `.metadata`
object exists: DCP writes it last, so it is the commit point.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
from pathlib import Path
from typing import Any

from dcp_fsdp.config import (MIB, PrefixStrategy, ReaderKind, StorageConfig, StorageKind,
                             parse_s3_uri)
from dcp_fsdp.errors import UserError

METADATA_NAME = ".metadata"  # written last by DCP: its presence marks a complete checkpoint
MANIFEST_NAME = "dcp_fsdp.json"  # what was saved (model, dtype, state), written after .metadata


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    suffix: str
    complete: bool
    size_bytes: int
    object_count: int
    modified: str  # ISO 8601, UTC, of the newest object


def new_suffix(now: datetime.datetime | None = None) -> str:
    """e.g. 2026-11-22-13-45-ab12: sorts by time, random tail keeps parallel runs apart."""
    now = now or datetime.datetime.now()
    return now.strftime("%Y-%m-%d-%H-%M-") + secrets.token_hex(2)


def resolve_region(storage: StorageConfig) -> str:
    return (storage.region or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")


def resolve_endpoint(storage: StorageConfig) -> str | None:
    return storage.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL") or None


class S3Backend:
    kind = StorageKind.s3

    def __init__(self, storage: StorageConfig) -> None:
        assert storage.uri is not None
        self.config = storage
        self.uri = storage.uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(storage.uri)
        self.region = resolve_region(storage)
        self.endpoint = resolve_endpoint(storage)
        if storage.endpoint:
            # s3torchconnector's CRT client takes no endpoint argument; it reads this variable.
            os.environ["AWS_ENDPOINT_URL"] = storage.endpoint
        self.force_path_style = (storage.force_path_style if storage.force_path_style is not None
                                 else self.endpoint is not None)
        self._boto_client = None

    # -- locations -------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        return f"{self.uri}/{suffix}"

    def _key(self, suffix: str, name: str = "") -> str:
        parts = [p for p in (self.prefix, suffix, name) if p]
        return "/".join(parts)

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

    @staticmethod
    def warm_up(storage_io) -> None:
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

        constructor = {
            ReaderKind.dcp_optimized: S3ReaderConstructor.dcp_optimized,
            ReaderKind.sequential: S3ReaderConstructor.sequential,
            ReaderKind.range_based: S3ReaderConstructor.range_based,
        }[self.config.reader]()
        return S3StorageReader(region=self.region, path=self.location(suffix),
                               s3client_config=self._client_config(),
                               reader_constructor=constructor)

    # -- control plane (boto3: fast failures, listing, small objects) -------------------
    def boto_client(self):
        if self._boto_client is None:
            import boto3
            import botocore.config

            self._boto_client = boto3.client(
                "s3", region_name=self.region, endpoint_url=self.endpoint,
                config=botocore.config.Config(
                    connect_timeout=self.config.connect_timeout_s, read_timeout=30,
                    retries={"mode": "standard", "total_max_attempts": 2},
                    s3={"addressing_style": "path" if self.force_path_style else "auto"},
                ),
            )
        return self._boto_client

    def _explain(self, error: BaseException) -> UserError:
        """One line for a boto3 failure against this bucket."""
        import botocore.exceptions as bx

        where = f"storage.uri={self.uri}"
        if isinstance(error, bx.NoCredentialsError):
            return UserError(f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use an instance role")
        if isinstance(error, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                              bx.ReadTimeoutError)):
            target = self.endpoint or f"AWS S3 in {self.region}"
            return UserError(f"storage.endpoint={target}: cannot connect ({type(error).__name__}); "
                             "check the address and that the server is up")
        if isinstance(error, bx.ClientError):
            response = error.response
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            if code in ("404", "NoSuchBucket"):
                return UserError(f"{where}: bucket '{self.bucket}' does not exist; create it or "
                                 "fix the bucket name")
            if status == 301 or code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
                actual = headers.get("x-amz-bucket-region", "another region")
                return UserError(f"storage.region={self.region}: bucket '{self.bucket}' is in "
                                 f"{actual}; set storage.region={actual}")
            if code in ("403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId",
                        "InvalidToken", "ExpiredToken"):
                return UserError(f"{where}: S3 refused the credentials (HTTP {status} {code}); "
                                 "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE "
                                 "and the bucket policy")
            return UserError(f"{where}: S3 answered HTTP {status} {code}")
        if isinstance(error, bx.BotoCoreError):
            return UserError(f"{where}: {type(error).__name__}: {error}")
        raise error

    def preflight(self) -> None:
        """Fail in seconds (not after the CRT's retries) on bad bucket, keys or endpoint."""
        import botocore.exceptions as bx

        client = self.boto_client()
        # The CRT client signs for storage.region and would fail every request (after its
        # retries) in another region. boto3 follows a 301 to the bucket's region by itself
        # (and an S3-compatible server may then accept it), so a redirect seen on the way
        # is a mismatch on any endpoint.
        redirects: list[str | None] = []

        def on_response(response_dict=None, **_):
            if response_dict and response_dict.get("status_code") == 301:
                redirects.append(response_dict.get("headers", {}).get("x-amz-bucket-region"))

        client.meta.events.register("response-received.s3.HeadBucket", on_response)
        try:
            response = client.head_bucket(Bucket=self.bucket)
        except (bx.BotoCoreError, bx.ClientError) as error:
            raise self._explain(error) from None
        bucket_region = redirects[0] if redirects else None
        if not redirects and (self.endpoint is None or "amazonaws.com" in self.endpoint):
            # AWS names the bucket's region; S3-compatible servers often report a nominal
            # one that does not matter, so only AWS endpoints are checked without a redirect.
            bucket_region = response.get("BucketRegion") or response.get(
                "ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        if bucket_region and bucket_region != self.region:
            raise UserError(f"storage.region={self.region}: bucket '{self.bucket}' is in "
                            f"{bucket_region}; set storage.region={bucket_region}")
        if redirects and bucket_region is None:
            raise UserError(f"storage.region={self.region}: bucket '{self.bucket}' is in "
                            "another region; set storage.region to the bucket's region")

    def list_checkpoints(self) -> list[CheckpointInfo]:
        import botocore.exceptions as bx

        client = self.boto_client()
        base = f"{self.prefix}/" if self.prefix else ""
        found: dict[str, dict[str, Any]] = {}
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    rest = obj["Key"][len(base):]
                    if "/" not in rest:
                        continue
                    suffix, name = rest.split("/", 1)
                    entry = found.setdefault(suffix, {"size": 0, "count": 0, "modified": None,
                                                      "complete": False})
                    entry["size"] += obj["Size"]
                    entry["count"] += 1
                    modified = obj["LastModified"]
                    if entry["modified"] is None or modified > entry["modified"]:
                        entry["modified"] = modified
                    if name == METADATA_NAME:
                        entry["complete"] = True
        except (bx.BotoCoreError, bx.ClientError) as error:
            raise self._explain(error) from None
        return [CheckpointInfo(suffix, e["complete"], e["size"], e["count"],
                               e["modified"].astimezone(datetime.timezone.utc).isoformat())
                for suffix, e in sorted(found.items())]

    def has_objects(self, suffix: str) -> bool:
        response = self.boto_client().list_objects_v2(
            Bucket=self.bucket, Prefix=self._key(suffix) + "/", MaxKeys=1)
        return response.get("KeyCount", 0) > 0

    def is_complete(self, suffix: str) -> bool:
        import botocore.exceptions as bx

        try:
            self.boto_client().head_object(Bucket=self.bucket, Key=self._key(suffix, METADATA_NAME))
            return True
        except bx.ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._explain(error) from None

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        self.boto_client().put_object(Bucket=self.bucket, Key=self._key(suffix, name), Body=data)

    def get_small(self, suffix: str, name: str) -> bytes | None:
        import botocore.exceptions as bx

        try:
            response = self.boto_client().get_object(Bucket=self.bucket,
                                                     Key=self._key(suffix, name))
            return response["Body"].read()
        except bx.ClientError:
            return None


class FsBackend:
    kind = StorageKind.fs

    def __init__(self, storage: StorageConfig) -> None:
        assert storage.path is not None
        self.config = storage
        self.root = Path(storage.path).expanduser().absolute()

    def location(self, suffix: str) -> str:
        return str(self.root / suffix)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fs", "path": str(self.root)}

    def writer(self, suffix: str):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.location(suffix), thread_count=self.config.thread_count,
                                overwrite=False)

    @staticmethod
    def warm_up(storage_io) -> None:
        """Nothing to set up for a file system."""

    def reader(self, suffix: str):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.location(suffix))

    def preflight(self) -> None:
        probe = self.root / f".dcp-fsdp-probe-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"probe")
            probe.unlink()
        except OSError as error:
            raise UserError(f"storage.path={self.root}: not writable ({error.strerror or error}); "
                            "choose a directory you can write to") from None

    def list_checkpoints(self) -> list[CheckpointInfo]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(self.root.iterdir()):
            if not entry.is_dir():
                continue
            files = [f for f in entry.rglob("*") if f.is_file()]
            newest = max((f.stat().st_mtime for f in files), default=entry.stat().st_mtime)
            found.append(CheckpointInfo(
                entry.name, (entry / METADATA_NAME).exists(), sum(f.stat().st_size for f in files),
                len(files),
                datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat()))
        return found

    def has_objects(self, suffix: str) -> bool:
        path = self.root / suffix
        return path.exists() and any(path.iterdir())

    def is_complete(self, suffix: str) -> bool:
        return (self.root / suffix / METADATA_NAME).exists()

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        path = self.root / suffix / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get_small(self, suffix: str, name: str) -> bytes | None:
        path = self.root / suffix / name
        return path.read_bytes() if path.exists() else None


Backend = S3Backend | FsBackend


def make_backend(storage: StorageConfig) -> Backend:
    if storage.kind == StorageKind.fs:
        return FsBackend(storage)
    return S3Backend(storage)


def check_loadable(backend: Backend, suffix: str) -> None:
    """UserError unless `suffix` names a complete checkpoint; lists the ones that exist."""
    if backend.is_complete(suffix):
        return
    checkpoints = backend.list_checkpoints()
    complete = [c.suffix for c in checkpoints if c.complete]
    where = backend.location("")
    state = ("is incomplete (no .metadata: the save did not finish)"
             if backend.has_objects(suffix) else "does not exist")
    listing = ", ".join(complete[-10:]) if complete else "none"
    raise UserError(f"suffix={suffix}: checkpoint {state} under {where}; "
                    f"complete checkpoints there: {listing}")


def read_manifest(backend: Backend, suffix: str) -> dict[str, Any] | None:
    data = backend.get_small(suffix, MANIFEST_NAME)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None
