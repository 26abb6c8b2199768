"""Checks beyond types, before any rank starts. Every error names the setting and the fix."""

from __future__ import annotations

import re

from dcp_fsdp.config.schema import BenchmarkConfig, Command, PrefixStrategy, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.presets import PRESETS
from dcp_fsdp.storage import layout

S3_MIN_PART_SIZE_MIB = 5  # S3 rejects multipart parts below 5 MiB (except the last)
S3_MAX_PART_SIZE_MIB = 5 * 1024

_S3_URI = re.compile(r"^s3://(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) or UserError."""
    match = _S3_URI.match(uri)
    if not match:
        raise UserError(f"storage.uri={uri}: not an S3 URI; write it as s3://bucket/prefix")
    bucket, prefix = match["bucket"], (match["prefix"] or "").strip("/")
    if not _BUCKET.match(bucket) or ".." in bucket or re.match(r"^\d+\.\d+\.\d+\.\d+$", bucket):
        raise UserError(
            f"storage.uri={uri}: '{bucket}' is not a valid S3 bucket name; use 3-63 lowercase "
            "letters, digits, dots and hyphens, starting and ending with a letter or digit")
    return bucket, prefix


def validate(cfg: BenchmarkConfig) -> None:
    """Checks beyond types. Raises UserError naming the setting and the fix."""
    if cfg.model.preset not in PRESETS:
        raise UserError(f"model={cfg.model.preset}: unknown preset; choose one of "
                        + ", ".join(PRESETS))
    if cfg.iterations < 1:
        raise UserError(f"iterations={cfg.iterations}: must be 1 or more")
    if cfg.nproc < 1:
        raise UserError(f"nproc={cfg.nproc}: must be 1 or more")
    if cfg.op_timeout_s <= 0:
        raise UserError(f"op_timeout_s={cfg.op_timeout_s}: must be positive (seconds)")
    if cfg.delay_s < 0:
        raise UserError(f"delay_s={cfg.delay_s}: must be 0 or more")
    if cfg.command == Command.load and not cfg.suffix:
        raise UserError("suffix is not set: `load` needs the suffix a save printed, e.g. "
                        "suffix=2026-11-22-13-45-ab12 (`dcp-fsdp list` shows them)")
    if cfg.suffix is not None:
        layout.check_suffix(cfg.suffix)
    storage = cfg.storage
    if storage.kind == StorageKind.fs:
        if not storage.path:
            raise UserError("storage.path is not set: give the directory for storage=fs, "
                            "e.g. storage.path=/fsx/checkpoints")
        return
    if storage.uri is not None:
        parse_s3_uri(storage.uri)
    elif storage.endpoint:
        raise UserError(f"storage.uri is not set but storage.endpoint={storage.endpoint} is: "
                        "give the bucket too, e.g. storage.uri=s3://my-bucket/checkpoints")
    if storage.endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", storage.endpoint):
        raise UserError(f"storage.endpoint={storage.endpoint}: write it as http(s)://host:port")
    if not S3_MIN_PART_SIZE_MIB <= storage.part_size_mib <= S3_MAX_PART_SIZE_MIB:
        raise UserError(f"storage.part_size_mib={storage.part_size_mib}: S3 multipart parts must "
                        f"be {S3_MIN_PART_SIZE_MIB}..{S3_MAX_PART_SIZE_MIB} MiB")
    if storage.max_attempts < 1:
        raise UserError(f"storage.max_attempts={storage.max_attempts}: must be 1 or more")
    if storage.thread_count < 1:
        raise UserError(f"storage.thread_count={storage.thread_count}: must be 1 or more")
    if storage.throughput_target_gbps <= 0:
        raise UserError(f"storage.throughput_target_gbps={storage.throughput_target_gbps}: "
                        "must be positive")
    if storage.prefix_strategy == PrefixStrategy.round_robin and not storage.round_robin_prefixes:
        raise UserError("storage.round_robin_prefixes is empty: prefix_strategy=round_robin needs "
                        "a list, e.g. 'storage.round_robin_prefixes=[a,b,c]'")
