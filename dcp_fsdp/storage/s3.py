"""The S3 store: s3torchconnector's DCP writer and reader (data plane), over one
resolved target, with boto3 for the control plane (`s3_control.py`).

The connector's native (CRT) client takes no endpoint argument: it reads
AWS_ENDPOINT_URL. `connector_environment()` says what the rank must set before it
builds a writer or reader; this module never writes the environment itself.
"""

from __future__ import annotations

import datetime

import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp.units import MIB
from dcp_fsdp.compat import round_robin_prefix_strategy
from dcp_fsdp.config.schema import PrefixStrategy, ReaderKind, StorageClient, StorageConfig
from dcp_fsdp.storage.layout import (CLAIM_CONDITIONAL, CLAIM_NAME, CLAIM_NOT_ATOMIC,
                                     CheckpointInfo, SuffixClaim, check_suffix)
from dcp_fsdp.storage.raw import S3RawArea, s3_ceiling_prefix
from dcp_fsdp.storage.s3_control import S3ControlPlane
from dcp_fsdp.storage.s3_clients import FsspecClient, MscClient, client_versions
from dcp_fsdp.storage.s3_target import S3Target, resolve_endpoint, resolve_region
from dcp_fsdp.storage.base import host_state_kwargs, read_ahead_kwargs
from dcp_fsdp.storage.timeline import HookTimeline

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    from dcp_fsdp.storage.base import OpenUpload

__all__ = ["S3Store", "S3Target", "prefix_strategy", "resolve_endpoint", "resolve_region"]


def prefix_strategy(storage: StorageConfig, world_size: int | None = None) -> Any:
    """The connector's prefix strategy of storage.prefix_strategy: called with a rank, the
    start of that rank's object names (`<prefix><n>.distcp`). Without storage.prefix_count,
    binary and hex spread over the world size, which the connector reads from the process
    group; `world_size` gives it where there is none (`dcp-fsdp plan`)."""
    from s3torchconnector import dcp as s3dcp

    strategy = storage.prefix_strategy
    if strategy == PrefixStrategy.default:
        return s3dcp.DefaultPrefixStrategy()
    if strategy == PrefixStrategy.round_robin:
        return round_robin_prefix_strategy(storage.round_robin_prefixes)
    count = storage.prefix_count or world_size
    if strategy == PrefixStrategy.binary:
        return s3dcp.BinaryPrefixStrategy(prefix_count=count)
    return s3dcp.HexPrefixStrategy(prefix_count=count)


class S3Store:
    kind = "s3"

    def __init__(self, storage: StorageConfig, after_failure: bool = False) -> None:
        self.config = storage
        self.target = S3Target.from_config(storage)
        self.control = S3ControlPlane(self.target, storage.connect_timeout_s,
                                      storage.connect_timeout_s if after_failure else None)
        # kept as attributes: tests and the run record read them
        self.uri, self.bucket, self.prefix = self.target.uri, self.target.bucket, self.target.prefix
        self.region, self.endpoint = self.target.region, self.target.endpoint
        self.force_path_style = self.target.force_path_style
        # storage.client=fsspec|msc: their writer and reader (s3_clients.py); None: the connector's
        self.other_client: FsspecClient | MscClient | None = (
            FsspecClient(self.target, storage) if storage.client == StorageClient.fsspec else
            MscClient(self.target, storage) if storage.client == StorageClient.msc else None)
        self.own_dir: Path | None = None  # msc: where its profile file lives (close() removes it)

    def connector_environment(self) -> dict[str, str]:
        """Variables the client must see (set them before building a writer/reader): the CRT
        client's endpoint; MSC's profile file, written now into a directory of this process."""
        found = {"AWS_ENDPOINT_URL": self.config.endpoint} if self.config.endpoint else {}
        if isinstance(self.other_client, MscClient):
            from dcp_fsdp.process.lifeline import owned_tempdir

            if self.own_dir is None:
                self.own_dir = owned_tempdir("dcp-fsdp-msc-")
            found.update(self.other_client.write_profile(self.own_dir))
        return found

    def close(self) -> None:
        """What this process made for the store (MSC's profile file) goes."""
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None

    # -- locations -------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        return f"{self.uri}/{suffix}"

    def describe(self) -> dict[str, Any]:
        return {"kind": "s3", "uri": self.uri, "bucket": self.bucket, "region": self.region,
                "endpoint": self.endpoint, "force_path_style": self.force_path_style,
                "client": self.config.client.value,
                "client_versions": client_versions(self.config.client)}

    # -- DCP writer / reader -----------------------------------------------------------
    def _client_config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(
            throughput_target_gbps=self.config.throughput_target_gbps,
            part_size=self.config.part_size_mib * MIB,
            force_path_style=self.force_path_style,
            max_attempts=self.config.max_attempts,
        )

    def writer(self, suffix: str, timeline: HookTimeline | None = None,
               host_state: bool = False) -> StorageWriter:
        if self.other_client is not None:
            return self.other_client.writer(suffix, timeline, host_state)
        from s3torchconnector.dcp import S3StorageWriter

        writer_class: type = S3StorageWriter
        extra: dict[str, Any] = {}
        if timeline is not None:
            from dcp_fsdp.storage.timed_s3 import TimedS3StorageWriter

            writer_class, extra = TimedS3StorageWriter, {"timeline": timeline}
        return writer_class(
            **extra, region=self.region, path=self.location(suffix), s3client_config=self._client_config(),
            prefix_strategy=prefix_strategy(self.config), thread_count=self.config.thread_count,
            overwrite=False, **host_state_kwargs(host_state),
        )

    def warm_up(self, storage_io: StorageWriter | StorageReader) -> None:
        """Build the connector's native (CRT) client now, outside the timed region.

        s3torchconnector creates it lazily on the first request; the first
        save of a process otherwise pays ~1 s of client set-up (credential chain,
        event loop, thread pools) inside the timer. Connections are not opened here:
        those are part of the I/O a checkpoint really pays.
        """
        if self.other_client is not None:
            self.other_client.warm_up(storage_io)
            return
        from dcp_fsdp import log
        from dcp_fsdp.compat import build_native_client
        from dcp_fsdp.storage.timed_fs import client_file_system

        build_native_client(client_file_system(storage_io), log.warning)  # once when it cannot

    def client_events(self, storage_io: StorageWriter | StorageReader) -> list[Any]:
        """The botocore event emitters of the client under `storage_io` (built: warm_up),
        where the request statistics hook in; [] for the connector (its own log says them)."""
        return [] if self.other_client is None else self.other_client.warm_up(storage_io)

    def drop_cache(self, suffix: str, share: tuple[int, int] = (0, 1)) -> None:
        """No local cache between a load and S3 (every read is a GET)."""
        return None

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> StorageReader:
        if self.other_client is not None:
            return self.other_client.reader(suffix, timeline)
        from s3torchconnector.dcp import S3StorageReader

        kwargs = dict(region=self.region, path=self.location(suffix),
                      s3client_config=self._client_config())
        if self.config.read_ahead:  # the tool's reader: a ranged GET per range group
            from s3torchconnector import S3ReaderConstructor

            from dcp_fsdp.storage.timed_s3 import TimedReadAheadS3StorageReader, TimedReaderConstructor

            timeline = timeline or HookTimeline()
            return TimedReadAheadS3StorageReader(
                timeline=timeline, **kwargs, **read_ahead_kwargs(self.config),
                reader_constructor=TimedReaderConstructor(S3ReaderConstructor.range_based(),
                                                          timeline.storage_clock))
        if timeline is None:
            return S3StorageReader(**kwargs, reader_constructor=self._reader_constructor())
        from dcp_fsdp.storage.timed_s3 import TimedS3StorageReader

        return TimedS3StorageReader(timeline=timeline, **kwargs,
                                    reader_constructor=self._reader_constructor(timeline))

    def _reader_constructor(self, timeline: HookTimeline | None = None) -> Any:
        """The connector's reader constructor of `storage.reader`; with a timeline, its
        chunk iterator clocked (storage/timed_s3.py)."""
        from s3torchconnector import S3ReaderConstructor

        max_gap_size = int(self.config.max_gap_size_mib * MIB)
        if timeline is not None:
            from dcp_fsdp.storage.timed_s3 import TimedDcpOptimizedConstructor, TimedReaderConstructor

            if self.config.reader == ReaderKind.dcp_optimized:
                return TimedDcpOptimizedConstructor(timeline.storage_clock, max_gap_size)
            return TimedReaderConstructor(self._reader_constructor(), timeline.storage_clock)
        if self.config.reader == ReaderKind.dcp_optimized:
            return S3ReaderConstructor.dcp_optimized(max_gap_size=max_gap_size)
        return {
            ReaderKind.sequential: S3ReaderConstructor.sequential,
            ReaderKind.range_based: S3ReaderConstructor.range_based,
        }[self.config.reader]()

    # -- control plane (boto3), see s3_control.py ---------------------------------------
    def preflight(self, writes: bool = True) -> None:
        self.control.preflight()  # HeadBucket: what a read needs, and a write's first check

    def list_checkpoints(self, suffix: str | None = None) -> list[CheckpointInfo]:
        return self.control.list_checkpoints(suffix)

    def has_objects(self, suffix: str) -> bool:
        return self.control.has_objects(suffix)

    def object_sizes(self, suffix: str) -> dict[str, int]:
        return self.control.object_sizes(suffix)

    def is_complete(self, suffix: str) -> bool:
        return self.control.is_complete(suffix)

    def claim(self, suffix: str, data: bytes) -> SuffixClaim:
        key = self.target.key(suffix, CLAIM_NAME)
        if self.control.honours_if_none_match():
            return SuffixClaim(self.control.put_if_absent(key, data), CLAIM_CONDITIONAL)
        self.control.put_key(key, data)  # the caller found no objects there just before
        return SuffixClaim(True, CLAIM_NOT_ATOMIC)

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        self.control.put_small(suffix, name, data)

    def get_small(self, suffix: str, name: str, max_bytes: int | None = None) -> bytes | None:
        return self.control.get_small(suffix, name, max_bytes)

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
        return S3RawArea(self.bucket, s3_ceiling_prefix(self.prefix, token), self.region,
                         self._client_config)

    def clean_raw_area(self, token: str) -> int:
        prefix = s3_ceiling_prefix(self.prefix, token) + "/"
        aborted = self.control.abort_uploads_under(prefix)
        self.control.delete_prefix(prefix)
        return aborted

    def open_uploads(self, suffix: str | None = None) -> list[OpenUpload]:
        return self.control.open_uploads(suffix)

    def abort_uploads(self, suffix: str | None = None, min_age_s: float = 0.0,
                      now: datetime.datetime | None = None) -> int:
        return self.control.abort_uploads(suffix, min_age_s, now)

