"""The DCP clients that put checkpoints on S3 (`storage.client=`; their pitfalls and fixes:
docs/clients.md): one class each behind one contract, `S3Client`, named in `s3.CLIENTS`. The S3
store holds one and never asks which. Credentials come from the standard AWS chain only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol, cast

from dcp_fsdp import log
from dcp_fsdp.compat import build_native_client, msc_botocore_events, round_robin_prefix_strategy
from dcp_fsdp.config.schema import PrefixStrategy, ReaderKind, StorageClient, StorageConfig
from dcp_fsdp.config.validate import CLIENT_ONLY
from dcp_fsdp.storage.base import built, host_state_kwargs, read_ahead_reader
from dcp_fsdp.storage.s3_target import S3Target, botocore_retry
from dcp_fsdp.storage.timeline import HookTimeline
from dcp_fsdp.units import MIB


class S3Client(Protocol):
    """What every client implements; the defaults are those of a client with no files of its
    own and no retry settings (botocore's, from AWS_RETRY_MODE / AWS_MAX_ATTEMPTS)."""

    name: str  # storage.client's value: the record's storage.client
    packages: tuple[str, ...]  # what carries its bytes: the record's storage.client_versions
    settings: frozenset[str]  # the storage.* settings it alone reads (refused for the others)
    target: S3Target
    config: StorageConfig

    def __init__(self, target: S3Target, config: StorageConfig) -> None:
        self.target, self.config = target, config

    def location(self, suffix: str) -> str:
        return f"{self.target.uri}/{suffix}"

    def environment(self) -> dict[str, str]:
        """Variables a rank sets before it builds a writer or reader."""
        return {}

    def close(self) -> None:
        """At the end of the process: remove what environment() made."""

    def retry(self) -> dict[str, Any]:
        """The retry mode and most attempts of its data requests (the record's storage block)."""
        return botocore_retry()

    # DCP's StorageWriter / Reader and the warm-up, as base.CheckpointStore says them
    def writer(self, suffix: str, timeline: HookTimeline | None = None, host_state: bool = False) -> Any: ...

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any: ...

    def warm_up(self, storage_io: Any) -> list[Any]: ...


def prefix_strategy(storage: StorageConfig, world_size: int | None = None) -> Any:
    """The connector's strategy of storage.prefix_strategy (called with a rank: the start of its
    object names). Without storage.prefix_count, binary and hex spread over the world size:
    the process group's, or `world_size` where there is none (`dcp-fsdp plan`)."""
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


def connector_config(target: S3Target, config: StorageConfig) -> Any:
    """The connector's S3ClientConfig (also the raw ceiling's client: raw.py)."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(throughput_target_gbps=config.throughput_target_gbps,
                          part_size=config.part_size_mib * MIB,
                          force_path_style=target.force_path_style,
                          max_attempts=config.max_attempts)


class ConnectorClient(S3Client):
    name = StorageClient.s3torchconnector.value
    packages: tuple[str, ...] = ("s3torchconnector", "s3torchconnectorclient")
    settings = CLIENT_ONLY[StorageClient.s3torchconnector]

    def retry(self) -> dict[str, Any]:
        # the CRT's standard retry strategy: AWS_RETRY_MODE and AWS_MAX_ATTEMPTS never reach it
        return {"retry_mode": "crt_standard", "max_attempts": self.config.max_attempts}

    def _common(self, suffix: str) -> dict[str, Any]:
        return {"region": self.target.region, "path": self.location(suffix),
                "s3client_config": connector_config(self.target, self.config)}

    def writer(self, suffix: str, timeline: HookTimeline | None = None, host_state: bool = False) -> Any:
        from s3torchconnector.dcp import S3StorageWriter

        from dcp_fsdp.storage.timed_s3 import TimedS3StorageWriter

        return built(S3StorageWriter, TimedS3StorageWriter, timeline, **self._common(suffix),
                     prefix_strategy=prefix_strategy(self.config), thread_count=self.config.thread_count,
                     overwrite=False, **host_state_kwargs(host_state))

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        from s3torchconnector import S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader

        import dcp_fsdp.storage.timed_s3 as timed_s3

        if self.config.read_ahead:  # the tool's reader: a ranged GET per range group
            timeline = timeline or HookTimeline()
            ranged = timed_s3.TimedReaderConstructor(S3ReaderConstructor.range_based(), timeline.storage_clock)
            return read_ahead_reader(timed_s3.TimedReadAheadS3StorageReader, self.config, timeline,
                                     reader_constructor=ranged, **self._common(suffix))
        return built(S3StorageReader, timed_s3.TimedS3StorageReader, timeline, **self._common(suffix),
                     reader_constructor=self._reader_constructor(timeline))

    def _reader_constructor(self, timeline: HookTimeline | None = None) -> Any:
        """The connector's constructor of `storage.reader`; with a timeline, its chunks clocked."""
        from s3torchconnector import S3ReaderConstructor

        import dcp_fsdp.storage.timed_s3 as timed_s3

        max_gap_size = int(self.config.max_gap_size_mib * MIB)
        if self.config.reader == ReaderKind.dcp_optimized:
            if timeline is None:
                return S3ReaderConstructor.dcp_optimized(max_gap_size=max_gap_size)
            return timed_s3.TimedDcpOptimizedConstructor(timeline.storage_clock, max_gap_size)
        plain = getattr(S3ReaderConstructor, self.config.reader.value)()  # sequential, range_based
        return plain if timeline is None else timed_s3.TimedReaderConstructor(plain, timeline.storage_clock)

    def warm_up(self, storage_io: Any) -> list[Any]:
        """The native (CRT) client built now: the connector builds it on the first request, and
        ~1 s of set-up would be inside the first timed save. No connection is opened (that is
        the checkpoint's I/O); no botocore events (the connector's log says its requests)."""
        from dcp_fsdp.storage.timed_fs import client_file_system

        build_native_client(client_file_system(storage_io), log.warning)  # once when it cannot
        return []


_KEY = "dcp_fsdp_object"  # where a request's object waits in botocore's request context


def _note_object(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    context[_KEY] = f"s3://{params.get('Bucket', '')}/{params.get('Key', '')}"


def _name_object(parsed: dict[str, Any], context: dict[str, Any], model: Any, **_: Any) -> None:
    """An error answer's message names S3's code, the request and its object: s3fs raises the
    message alone ("[Errno 22] Bad Request", issue 49), and a rank's error reaches the
    coordinator pickled, without the botocore error behind it."""
    error = parsed.get("Error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and error.get("Code") and context.get(_KEY):
        error["Message"] = (f"{error.get('Message') or 'no message'} (S3 {error['Code']}, "
                            f"{getattr(model, 'name', 'request')} {context[_KEY]})")


def quiet_broken_connection_tasks(loop: Any, context: dict[str, Any]) -> None:
    """fsspec's event loop's exception handler: an aiohttp task left with a connection error
    (its request's connection broke) is dropped, not printed as "Task exception was never
    retrieved": the request fails with that error, which the rank reports in its one line."""
    if not (context.get("message") == "Task exception was never retrieved"
            and isinstance(context.get("exception"), ConnectionError)):
        loop.default_exception_handler(context)


class FsspecClient(S3Client):
    name = StorageClient.fsspec.value
    packages: tuple[str, ...] = ("s3fs", "aiobotocore", "botocore", "fsspec")
    settings = CLIENT_ONLY[StorageClient.fsspec]

    def retry(self) -> dict[str, Any]:
        """The user's AWS_RETRY_MODE or profile's, else standard, as MSC's: botocore's legacy
        retries a refused connection 5 times with up to 15 s of backoff, on each of the three
        requests a failed save makes: 20-30 s after a server died (issue 49)."""
        return botocore_retry(default="standard")

    def storage_options(self) -> dict[str, Any]:
        """s3fs's constructor arguments (torch passes them through `url_to_fs`)."""
        botocore_config: dict[str, Any] = {"max_pool_connections": self.config.fsspec_max_pool_connections,
                                           "retries": {"mode": self.retry()["retry_mode"]}}
        if self.target.force_path_style:
            botocore_config["s3"] = {"addressing_style": "path"}
        options: dict[str, Any] = {"client_kwargs": {"region_name": self.target.region},
                                   "config_kwargs": botocore_config,
                                   "default_block_size": self.config.fsspec_block_size_mib * MIB}
        if self.target.endpoint:
            options["endpoint_url"] = self.target.endpoint
        return options

    def writer(self, suffix: str, timeline: HookTimeline | None = None, host_state: bool = False) -> Any:
        import dcp_fsdp.storage.timed_clients as timed_clients

        return built(timed_clients.FsspecWriter, timed_clients.TimedFsspecWriter, timeline,
                     self.location(suffix), sync_files=self.config.fsspec_sync_files,
                     thread_count=self.config.thread_count, overwrite=False,
                     **host_state_kwargs(host_state), **self.storage_options())

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        import dcp_fsdp.storage.timed_clients as timed_clients

        if self.config.read_ahead:  # the tool's reader: cat_file per range group
            return read_ahead_reader(timed_clients.TimedReadAheadFsspecReader, self.config, timeline,
                                     self.location(suffix), **self.storage_options())
        return built(timed_clients.FsspecReader, timed_clients.TimedFsspecReader, timeline,
                     self.location(suffix), **self.storage_options())

    def warm_up(self, storage_io: Any) -> list[Any]:
        """s3fs's aiobotocore client built now (s3fs builds it on the first request), its
        errors made to name their object; its event emitter, for the request statistics."""
        from dcp_fsdp.storage.timed_fs import client_file_system

        s3fs_filesystem = cast(Any, client_file_system(storage_io)).fs  # torch's fsspec FileSystem's
        s3fs_filesystem.connect()
        s3fs_filesystem.loop.set_exception_handler(quiet_broken_connection_tasks)
        events = s3fs_filesystem.s3.meta.events
        events.register("before-parameter-build.s3", _note_object, unique_id="dcp-fsdp-note-object")
        events.register("after-call.s3", _name_object, unique_id="dcp-fsdp-name-object")
        return [events]


MSC_PROFILE = "dcp-fsdp"  # the profile environment() writes


class MscClient(S3Client):
    name = StorageClient.msc.value
    packages: tuple[str, ...] = ("multi-storage-client", "boto3", "botocore")
    settings = CLIENT_ONLY[StorageClient.msc]
    own_dir: Path | None = None  # where its profile file lives (close() removes it)

    def location(self, suffix: str) -> str:
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        return f"msc://{MSC_PROFILE}/{prefix}{suffix}"

    def retry(self) -> dict[str, Any]:
        if self.config.msc_rust_client:  # its own retries (object_store's), not botocore's
            return {"retry_mode": "msc_rust", "max_attempts": None}
        return botocore_retry("standard")  # MSC's boto3 config fixes the mode, not the attempts

    def profile(self) -> dict[str, Any]:
        """MSC's configuration: one S3 profile, no credentials (the AWS chain gives them)."""
        options: dict[str, Any] = {
            "base_path": self.target.bucket, "region_name": self.target.region,
            "multipart_chunksize": self.config.msc_part_size_mib * MIB,
            "multipart_threshold": self.config.msc_multipart_threshold_mib * MIB,
            "max_concurrency": self.config.msc_max_concurrency}
        if self.target.endpoint:
            options["endpoint_url"] = self.target.endpoint
        if self.target.force_path_style:
            options["s3"] = {"addressing_style": "path"}
        if self.config.msc_rust_client:  # object_store refuses http:// unless allowed
            plain_http = str(self.target.endpoint or "").lower().startswith("http://")
            options["rust_client"] = {"allow_http": True} if plain_http else {}
        return {"profiles": {MSC_PROFILE: {"storage_provider": {"type": "s3", "options": options}}}}

    def environment(self) -> dict[str, str]:
        """The profile written now as a file; what the rank must set (MSC_CONFIG)."""
        from dcp_fsdp.process.lifeline import owned_tempdir

        if self.own_dir is None:
            self.own_dir = owned_tempdir("dcp-fsdp-msc-")
        path = self.own_dir / "msc-config.json"
        path.write_text(json.dumps(self.profile()))
        return {"MSC_CONFIG": str(path)}

    def close(self) -> None:
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None

    def writer(self, suffix: str, timeline: HookTimeline | None = None, host_state: bool = False) -> Any:
        import dcp_fsdp.storage.msc_dcp as msc_dcp  # .metadata any client can read

        return built(msc_dcp.PortableMscWriter, msc_dcp.TimedPortableMscWriter, timeline,
                     self.location(suffix), sync_files=False, thread_count=self.config.thread_count,
                     overwrite=False, **host_state_kwargs(host_state))

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        import dcp_fsdp.storage.msc_dcp as msc_dcp
        import dcp_fsdp.storage.timed_clients as timed_clients

        if self.config.read_ahead:  # the tool's reader: read(byte_range=...) per range group
            return read_ahead_reader(timed_clients.TimedReadAheadMscReader, self.config, timeline,
                                     self.location(suffix))
        # storage.msc_prefetch_threads: MSC's prefetch, each object downloaded once
        return built(msc_dcp.OnceMscReader, msc_dcp.TimedOnceMscReader, timeline, self.location(suffix),
                     prefetch_threads=self.config.msc_prefetch_threads)

    def warm_up(self, storage_io: Any) -> list[Any]:
        """MSC's client for the profile built now (MSC builds it on the first request, then
        keeps it per process); its boto3 event emitter, for the request statistics."""
        from multistorageclient.shortcuts import resolve_storage_client

        storage_client, _ = resolve_storage_client(self.location(""))
        events = None if self.config.msc_rust_client else msc_botocore_events(storage_client, log.warning)
        return [] if events is None else [events]
