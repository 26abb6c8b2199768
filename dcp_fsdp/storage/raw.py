"""Raw objects beside the checkpoints (`base.RawArea`): what the raw ceiling moves with the
client DCP's writer and reader use, never where `list` looks: s3 `<uri>.ceiling/<token>/`
(`s3://bucket/_dcp_fsdp.ceiling/<token>/` without a prefix), fs `<path>.ceiling/<token>/`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import dcp_fsdp.storage.pagecache as pagecache
from dcp_fsdp.compat import object_chunks, s3_client
from dcp_fsdp.storage.base import RawArea
from dcp_fsdp.storage.layout import CEILING_ROOT

Client = Any  # what open() returns: the connector's S3Client (untyped) for S3, None for fs


def s3_ceiling_prefix(prefix: str, token: str) -> str:
    return f"{prefix}.ceiling/{token}" if prefix else f"{CEILING_ROOT}/{token}"


def fs_ceiling_dir(root: Path, token: str) -> Path:
    return root.parent / f"{root.name}.ceiling" / token


class S3RawArea(RawArea):
    """PUT/GET/DELETE through s3torchconnector's S3Client: the native (CRT) client DCP's
    S3StorageWriter/Reader use, built from the same S3ClientConfig."""

    def __init__(self, bucket: str, base_key: str, region: str,
                 client_config: Callable[[], Any]) -> None:
        self.bucket, self.base_key, self.region = bucket, base_key, region
        self._client_config = client_config
        self.location = f"s3://{bucket}/{base_key}"

    def _key(self, name: str) -> str:
        return f"{self.base_key}/{name}"

    def open(self) -> Client:
        """A fresh client with its native client built (else built on the first request)."""
        return s3_client(self.region, self._client_config())

    def put(self, client: Client, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        writer = client.put_object(self.bucket, self._key(name))
        for chunk in chunks:
            writer.write(chunk)
        writer.close()

    def get(self, client: Client, name: str) -> int:
        """Through the native stream: no buffering reader."""
        return sum(len(chunk) for chunk in object_chunks(client, self.bucket, self._key(name)))

    def get_into(self, client: Client, name: str, target: memoryview) -> int:
        received = 0
        for chunk in object_chunks(client, self.bucket, self._key(name)):
            target[received:received + len(chunk)] = chunk
            received += len(chunk)
        return received

    def delete(self, client: Client, names: Iterable[str]) -> None:
        for name in names:
            client.delete_object(self.bucket, self._key(name))


class FsRawArea(RawArea):
    """Plain file writes (fsync'd as DCP's writer is told: storage.sync_files) and reads."""

    def __init__(self, base: Path, read_chunk_bytes: int, sync_files: bool = True) -> None:
        self.base = base
        self.read_chunk_bytes = read_chunk_bytes
        self.sync_files = sync_files
        self.location = str(base)

    def path(self, name: str) -> Path:
        return self.base / name

    def prepare(self, names: Iterable[str]) -> None:
        for name in names:
            self.path(name).parent.mkdir(parents=True, exist_ok=True)

    def put(self, client: Client, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)

    def drop_cache(self, names: Iterable[str]) -> str:
        return pagecache.drop(self.path(name) for name in names)

    def get(self, client: Client, name: str) -> int:
        buffer = bytearray(self.read_chunk_bytes)
        received = 0
        with open(self.path(name), "rb", buffering=0) as source:
            while count := source.readinto(buffer):
                received += count
        return received

    def get_into(self, client: Client, name: str, target: memoryview) -> int:
        received = 0
        with open(self.path(name), "rb", buffering=0) as source:
            while count := source.readinto(target[received:]):
                received += count
        return received

    def delete(self, client: Client, names: Iterable[str]) -> None:
        """Unlink these files, then every folder up to `<path>.ceiling` now empty (no barrier:
        the last rank removes them, so a failed round cleans up too)."""
        for name in names:
            path = self.path(name)
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty (another rank's files) or already gone
                for directory in path.parents[:len(path.relative_to(self.base.parent).parts)]:
                    directory.rmdir()
