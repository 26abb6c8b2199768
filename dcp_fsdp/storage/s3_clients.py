"""The DCP clients other than the connector that put a checkpoint on S3 (`storage.client=`;
docs/clients.md): torch's own `FsspecWriter` / `FsspecReader` over s3fs, and NVIDIA
multi-storage-client's `MultiStorageFileSystemWriter` / `Reader`. The S3 store
(`s3.py`) builds its writer and reader here for them, for the same target: the same
bucket, prefix, endpoint and region; credentials come from the standard AWS chain in every
client and are never written anywhere (MSC's profile file holds no key).

Pitfalls each builder applies a fix for (field notes, "Other clients"):
- fsspec: torch's `sync_files=True` calls a host-wide `os.sync()` after every file (an s3fs
  file has no fileno): off unless `storage.fsspec_sync_files=true`. The endpoint and keys
  go to the writer's constructor; no `checkpoint_id=` is ever passed to dcp.save/load
  (torch's `reset(checkpoint_id)` would rebuild the file system without them).
- msc: its profiles come from a file (`MSC_CONFIG`): `msc_environment()` writes one,
  holding the bucket, endpoint, region and the client's settings, and nothing secret.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcp_fsdp.units import MIB
from dcp_fsdp.config.schema import StorageClient, StorageConfig
from dcp_fsdp.storage.s3_target import S3Target
from dcp_fsdp.storage.base import host_state_kwargs, read_ahead_kwargs
from dcp_fsdp.storage.timeline import HookTimeline

MSC_PROFILE = "dcp-fsdp"  # the profile msc_environment() writes
MSC_CONFIG_ENV = "MSC_CONFIG"
VERSIONED = {StorageClient.s3torchconnector: ("s3torchconnector", "s3torchconnectorclient"),
             StorageClient.fsspec: ("s3fs", "aiobotocore", "botocore", "fsspec"),
             StorageClient.msc: ("multi-storage-client", "boto3", "botocore")}


def client_versions(client: StorageClient) -> dict[str, str]:
    """The versions of what carries this client's bytes (the record's `storage.client_versions`)."""
    from dcp_fsdp.compat import installed_version

    return {name: installed_version(name) for name in VERSIONED[client]}


class FsspecClient:
    """torch's fsspec path: s3fs under FsspecWriter / FsspecReader."""

    def __init__(self, target: S3Target, config: StorageConfig) -> None:
        self.target, self.config = target, config

    def location(self, suffix: str) -> str:
        return f"{self.target.uri}/{suffix}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs's constructor arguments (torch passes them through `url_to_fs`)."""
        botocore_config: dict[str, Any] = {"max_pool_connections": self.config.fsspec_max_pool_connections}
        if self.target.force_path_style:
            botocore_config["s3"] = {"addressing_style": "path"}
        options: dict[str, Any] = {"client_kwargs": {"region_name": self.target.region},
                                   "config_kwargs": botocore_config,
                                   "default_block_size": self.config.fsspec_block_size_mib * MIB}
        if self.target.endpoint:
            options["endpoint_url"] = self.target.endpoint
        return options

    def writer(self, suffix: str, timeline: HookTimeline | None, host_state: bool = False) -> Any:
        import dcp_fsdp.storage.timed_clients as timed_clients

        writer_class: type = timed_clients.FsspecWriter
        extra: dict[str, Any] = {}
        if timeline is not None:
            writer_class, extra = timed_clients.TimedFsspecWriter, {"timeline": timeline}
        return writer_class(self.location(suffix), sync_files=self.config.fsspec_sync_files,
                            thread_count=self.config.thread_count, overwrite=False, **extra,
                            **host_state_kwargs(host_state), **self.storage_options())

    def reader(self, suffix: str, timeline: HookTimeline | None) -> Any:
        import dcp_fsdp.storage.timed_clients as timed_clients

        if self.config.read_ahead:  # the tool's reader: cat_file per range group
            return timed_clients.TimedReadAheadFsspecReader(
                self.location(suffix), timeline=timeline or HookTimeline(),
                **read_ahead_kwargs(self.config), **self.storage_options())
        if timeline is None:
            return timed_clients.FsspecReader(self.location(suffix), **self.storage_options())
        return timed_clients.TimedFsspecReader(self.location(suffix), timeline=timeline,
                                               **self.storage_options())

    @staticmethod
    def warm_up(storage_io: Any) -> list[Any]:
        """s3fs's aiobotocore client built now (s3fs builds it on the first request); its
        event emitter, for the request statistics."""
        from dcp_fsdp.storage.timed_fs import client_file_system

        torch_filesystem: Any = client_file_system(storage_io)  # torch's fsspec FileSystem
        s3fs_filesystem = torch_filesystem.fs
        s3fs_filesystem.connect()
        return [s3fs_filesystem.s3.meta.events]


class MscClient:
    """NVIDIA multi-storage-client: paths msc://<profile>/<prefix>/<suffix>."""

    def __init__(self, target: S3Target, config: StorageConfig) -> None:
        self.target, self.config = target, config

    def location(self, suffix: str) -> str:
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        return f"msc://{MSC_PROFILE}/{prefix}{suffix}"

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
            options["rust_client"] = {"allow_http": True} if self._plain_http() else {}
        return {"profiles": {MSC_PROFILE: {"storage_provider": {"type": "s3", "options": options}}}}

    def _plain_http(self) -> bool:
        return bool(self.target.endpoint) and str(self.target.endpoint).lower().startswith("http://")

    def write_profile(self, directory: Path) -> dict[str, str]:
        """The profile as a file in `directory`; what the rank must set (MSC_CONFIG)."""
        path = directory / "msc-config.json"
        path.write_text(json.dumps(self.profile()))
        return {MSC_CONFIG_ENV: str(path)}

    def writer(self, suffix: str, timeline: HookTimeline | None, host_state: bool = False) -> Any:
        import dcp_fsdp.storage.msc_dcp as msc_dcp  # .metadata any client can read

        writer_class: type = msc_dcp.PortableMscWriter
        extra: dict[str, Any] = {}
        if timeline is not None:
            writer_class, extra = msc_dcp.TimedPortableMscWriter, {"timeline": timeline}
        return writer_class(self.location(suffix), sync_files=False,
                            thread_count=self.config.thread_count, overwrite=False, **extra,
                            **host_state_kwargs(host_state))

    def reader(self, suffix: str, timeline: HookTimeline | None) -> Any:
        import dcp_fsdp.storage.msc_dcp as msc_dcp
        import dcp_fsdp.storage.timed_clients as timed_clients

        if self.config.read_ahead:  # the tool's reader: read(byte_range=...) per range group
            return timed_clients.TimedReadAheadMscReader(
                self.location(suffix), timeline=timeline or HookTimeline(),
                **read_ahead_kwargs(self.config))
        # storage.msc_prefetch_threads: MSC's prefetch, each object downloaded once
        prefetch = self.config.msc_prefetch_threads
        if timeline is None:
            return msc_dcp.OnceMscReader(self.location(suffix), prefetch_threads=prefetch)
        return msc_dcp.TimedOnceMscReader(self.location(suffix), timeline=timeline,
                                          prefetch_threads=prefetch)

    def warm_up(self, storage_io: Any) -> list[Any]:
        """MSC's client for the profile built now (MSC builds it on the first request, then
        keeps it per process); its boto3 event emitter, for the request statistics."""
        from multistorageclient.shortcuts import resolve_storage_client

        from dcp_fsdp import log
        from dcp_fsdp.compat import msc_botocore_events

        storage_client, _ = resolve_storage_client(self.location(""))
        events = None if self.config.msc_rust_client else msc_botocore_events(storage_client, log.warning)
        return [] if events is None else [events]
