"""The one owner of how a checkpoint lies in storage, and of the suffix policy.

A checkpoint is `<root>/<suffix>/`: DCP's data objects, `.metadata` (written last by
DCP: its presence is the commit point, so a checkpoint without it is incomplete and
never loadable), and our manifest `dcp_fsdp.json` (what was saved: model, dtype, state,
world size, and the seed and version of the value function every load verifies against;
written after the commit).

Suffixes: a save without `suffix=` gets a fresh `YYYY-MM-DD-HH-MM-xxxx` (sorts by time;
the random tail keeps parallel runs apart); `suffix=NAME` with iterations > 1 becomes
`NAME-1`, `NAME-2`, ...; an existing suffix is never overwritten.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
from typing import Any

from dcp_fsdp.errors import UserError

METADATA_NAME = ".metadata"
MANIFEST_NAME = "dcp_fsdp.json"
# The raw ceiling's objects (rank/ceiling.py) go beside the checkpoints' prefix, in
# `<prefix>.ceiling/`; under a bare bucket, in this folder: no suffix can take its name
# (suffixes start with a letter or digit) and `list` skips it.
CEILING_ROOT = "_dcp_fsdp.ceiling"

_SUFFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    suffix: str
    complete: bool
    size_bytes: int
    object_count: int
    modified: str  # ISO 8601, UTC, of the newest object


# -- suffixes ------------------------------------------------------------------------------

def check_suffix(suffix: str) -> None:
    if not _SUFFIX.match(suffix):
        raise UserError(f"suffix={suffix}: start with an ASCII letter or digit, then use letters, "
                        "digits, '.', '_' and '-' only, e.g. suffix=run-1")


NAME_MAX_BYTES = 255  # a file or directory name on Linux file systems
KEY_MAX_BYTES = 1024  # an S3 object key
LONGEST_OBJECT_NAME = 64  # room for DCP's object names under a suffix (__0_0.distcp, ...)


def check_suffix_length(suffix: str, iterations: int, kind: str, prefix: str = "") -> None:
    """A suffix the storage cannot hold fails here, not after every rank built the model."""
    longest = configured_save_suffixes(suffix, iterations)[-1] if iterations > 1 else suffix
    size = len(longest.encode())
    if kind == "fs" and size > NAME_MAX_BYTES:
        raise UserError(f"suffix={suffix}: {longest!r} is {size} bytes, longer than a file "
                        f"name may be ({NAME_MAX_BYTES}); use a shorter suffix")
    limit = KEY_MAX_BYTES - LONGEST_OBJECT_NAME - len(prefix.encode())
    if kind == "s3" and size > limit:
        raise UserError(f"suffix={suffix}: {size} bytes; with the prefix and DCP's object "
                        f"names an S3 key would pass {KEY_MAX_BYTES} bytes: use at most {limit}")


def new_suffix(now: datetime.datetime | None = None) -> str:
    """e.g. 2026-11-22-13-45-ab12: sorts by time, random tail keeps parallel runs apart."""
    now = now or datetime.datetime.now()
    return now.strftime("%Y-%m-%d-%H-%M-") + secrets.token_hex(2)


def configured_save_suffixes(configured: str, iterations: int) -> list[str]:
    """The suffixes a save with `suffix=NAME` writes: NAME, or NAME-1 .. NAME-N."""
    if iterations == 1:
        return [configured]
    return [f"{configured}-{iteration}" for iteration in range(1, iterations + 1)]


def check_save_suffixes_free(store, configured: str, iterations: int) -> None:
    """Before any rank starts: a save never overwrites; say so now, not after the build."""
    for suffix in configured_save_suffixes(configured, iterations)[:100]:
        if store.has_objects(suffix):
            raise UserError(f"suffix={suffix}: a checkpoint already exists at "
                            f"{store.location(suffix)}; choose another suffix or omit it to "
                            "get a fresh one")


def save_suffix(store, configured: str | None, iterations: int, iteration: int,
                used: list[str]) -> str:
    """The suffix for save `iteration` (1-based) in `store`; never one that holds objects."""
    if configured:
        suffix = configured if iterations == 1 else f"{configured}-{iteration}"
        if store.has_objects(suffix):
            raise UserError(f"suffix={suffix}: a checkpoint already exists at "
                            f"{store.location(suffix)}; choose another suffix or omit it to "
                            "get a fresh one")
        return suffix
    while True:
        suffix = new_suffix()
        if suffix not in used and not store.has_objects(suffix):
            return suffix


# -- loadability ---------------------------------------------------------------------------

def check_loadable(store, suffix: str) -> None:
    """UserError unless `suffix` names a complete checkpoint; lists the ones that exist."""
    if store.is_complete(suffix):
        return
    checkpoints = store.list_checkpoints()
    complete = [c.suffix for c in checkpoints if c.complete]
    where = store.location("")
    state = ("is incomplete (no .metadata: the save did not finish)"
             if store.has_objects(suffix) else "does not exist")
    listing = ", ".join(complete[-10:]) if complete else "none"
    raise UserError(f"suffix={suffix}: checkpoint {state} under {where}; "
                    f"complete checkpoints there: {listing}")


# -- the manifest ------------------------------------------------------------------------

def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest).encode()


def read_manifest(store, suffix: str) -> dict[str, Any] | None:
    data = store.get_small(suffix, MANIFEST_NAME)
    if data is None:
        return None
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
