"""The one owner of how a checkpoint lies in storage, and of the suffix policy.

A checkpoint is `<root>/<suffix>/`: DCP's data objects, `.metadata` (DCP's commit point),
our manifest `dcp_fsdp.json` (written after the commit; every load verifies against it) and
the claim `dcp_fsdp.claim` (which run took the suffix, written first: a store's `claim`
creates it only if absent, so of two racing saves exactly one proceeds; docs/reliability.md).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp import contract
from dcp_fsdp.config.validate import check_suffix as check_suffix  # the suffix's syntax: a config check
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.metadata_peek import MAX_METADATA_BYTES, MetadataFacts, read_facts
from dcp_fsdp.storage.base import CheckpointInfo, OpenUpload as OpenUpload, SuffixClaim as SuffixClaim

if TYPE_CHECKING:
    from dcp_fsdp.storage.base import CheckpointStore

METADATA_NAME = ".metadata"
MANIFEST_NAME = "dcp_fsdp.json"
CLAIM_NAME = "dcp_fsdp.claim"
MAX_MANIFEST_BYTES = 64 * 1024  # ours hold a few hundred; a larger one is not ours
# How a save's suffix was claimed (the record's `suffix_claim`):
CLAIM_CONDITIONAL = "conditional_write"  # S3 PutObject If-None-Match: * (the server honours it)
CLAIM_EXCLUSIVE = "exclusive_create"  # file system: open(O_CREAT | O_EXCL)
CLAIM_NOT_ATOMIC = "not_atomic"  # the server ignores the condition: a check, then a write
# The raw ceiling's objects (rank/ceiling.py) go beside the checkpoints' prefix, in
# `<prefix>.ceiling/`; under a bare bucket, in this folder: no suffix can take its name
# (suffixes start with a letter or digit) and `list` skips it.
CEILING_ROOT = "_dcp_fsdp.ceiling"


# The objects that make a folder a checkpoint: DCP's commit, our manifest and our claim. A
# prefix strategy's data folders inside a checkpoint never hold one.
CHECKPOINT_MARKERS = frozenset({METADATA_NAME, MANIFEST_NAME, CLAIM_NAME})


def checkpoint_info(suffix: str, names: list[str], complete: bool, size_bytes: int,
                    modified: str) -> CheckpointInfo:
    """What `suffix` holds, from the names of its objects (relative to it). `nested`: the
    folders below it that hold a checkpoint of their own (a marker object)."""
    nested = {folder for folder, _, base in (name.rpartition("/") for name in names)
              if folder and base in CHECKPOINT_MARKERS}
    return CheckpointInfo(suffix, complete, size_bytes, len(names), modified,
                          claim_only=names == [CLAIM_NAME], nested=tuple(sorted(nested)),
                          own_object_count=sum("/" not in name for name in names))


# -- suffixes ------------------------------------------------------------------------------

def new_suffix(now: datetime.datetime | None = None) -> str:
    """e.g. 2026-11-22-13-45-ab12: sorts by time, random tail keeps parallel runs apart."""
    now = now or datetime.datetime.now()
    return now.strftime("%Y-%m-%d-%H-%M-") + secrets.token_hex(2)


def configured_save_suffix(configured: str, iterations: int, iteration: int) -> str:
    """The suffix save `iteration` (1-based) of `suffix=NAME` writes: NAME, or NAME-1 .. NAME-N."""
    return configured if iterations == 1 else f"{configured}-{iteration}"


def _first_configured_suffixes(configured: str, iterations: int) -> list[str]:
    return [configured_save_suffix(configured, iterations, i) for i in range(1, min(iterations, 100) + 1)]


def check_save_suffixes_free(store: CheckpointStore, configured: str, iterations: int) -> None:
    """Before any rank starts: a save never overwrites; say so now, not after the build."""
    for suffix in _first_configured_suffixes(configured, iterations):
        if store.has_objects(suffix):
            raise _exists(store, suffix)


def _exists(store: CheckpointStore, suffix: str) -> UserError:
    return UserError(f"suffix={suffix}: a checkpoint already exists at {store.location(suffix)} "
                     "(or another save is writing it); choose another suffix or omit it to get "
                     "a fresh one")


def save_suffix(store: CheckpointStore, configured: str | None, iterations: int, iteration: int,
                used: list[str]) -> tuple[str, str]:
    """The suffix for save `iteration` (1-based) in `store`, claimed for this save (never
    one that holds objects, nor one another save claimed first), and how it was claimed."""
    run_id = os.environ.get(contract.RUN_ID_ENV)
    if configured:
        suffix = configured_save_suffix(configured, iterations, iteration)
        launcher_method = os.environ.get(contract.SUFFIX_CLAIMED_ENV)
        if launcher_method and holds_only_claim_of(store, suffix, run_id):
            return suffix, launcher_method  # this run's launcher claimed it before the ranks
        return suffix, _claim_configured(store, suffix, run_id)
    while True:
        suffix = new_suffix()
        if suffix not in used and not store.has_objects(suffix):
            claim = store.claim(suffix, _claim_body(run_id))
            if claim.won:
                return suffix, claim.method


def _claim_configured(store: CheckpointStore, suffix: str, run_id: str | None) -> str:
    """Claim `suffix=NAME`'s `suffix` for this run (how it was claimed); UserError when it
    holds objects or another save claimed it first."""
    if store.has_objects(suffix):
        raise _exists(store, suffix)
    claim = store.claim(suffix, _claim_body(run_id))
    if not claim.won:
        raise UserError(f"suffix={suffix}: another save claimed it a moment ago"
                        f"{_claimed_by(store, suffix)} and writes there; this save wrote "
                        "nothing: choose another suffix or omit it to get a fresh one")
    return claim.method


def claim_configured_suffixes(store: CheckpointStore, configured: str, iterations: int,
                              run_id: str) -> tuple[list[str], str]:
    """The launcher, before any rank starts: claim the (first 100) suffixes `suffix=NAME` will
    write for run `run_id` (rank 0 takes them as its run's own), so the loser of a race is
    refused before its ranks start; on a lost claim, the ones taken are removed."""
    taken: list[str] = []
    method = CLAIM_EXCLUSIVE
    try:
        for suffix in _first_configured_suffixes(configured, iterations):
            method = _claim_configured(store, suffix, run_id)
            taken.append(suffix)
    except UserError:
        for suffix in taken:  # those still holding nothing but this run's claim
            if holds_only_claim_of(store, suffix, run_id):
                store.delete(suffix)
        raise
    return taken, method


def _claim_body(run_id: str | None) -> bytes:
    """Who claims (no secrets): the run, host and process, and when."""
    return json.dumps({"run_id": run_id, "host": socket.gethostname(),
                       "pid": os.getpid(), "claimed_at": datetime.datetime.now(
                           datetime.timezone.utc).isoformat(timespec="seconds")}).encode()


def read_claim(store: CheckpointStore, suffix: str) -> dict[str, Any]:
    """`suffix`'s claim object as written by `_claim_body` ({} when absent or unreadable)."""
    try:
        return _plain_object(store.get_small(suffix, CLAIM_NAME, 4096) or b"{}") or {}
    except UserError:
        return {}


def _plain_object(data: bytes) -> dict[str, Any] | None:
    """`data` as a JSON object of plain values (all a manifest or claim holds), else None."""
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return None
    plain = isinstance(parsed, dict) and all(
        value is None or isinstance(value, (str, int, float)) for value in parsed.values())
    return parsed if plain else None


def _claimed_by(store: CheckpointStore, suffix: str) -> str:
    """' (run R on host H)' from the other save's claim object, when it can be read."""
    claim = read_claim(store, suffix)
    if not claim.get("host"):
        return ""
    return f" (run {claim.get('run_id') or '?'} on host {claim['host']})"


def holds_only_claim_of(store: CheckpointStore, suffix: str, run_id: str | None) -> bool:
    """True when `suffix` holds nothing but run `run_id`'s claim: that run's save ended
    before it wrote anything there (a claim with no data is not a checkpoint)."""
    return (bool(run_id) and set(store.object_sizes(suffix)) == {CLAIM_NAME}
            and read_claim(store, suffix).get("run_id") == run_id)


# -- loadability ---------------------------------------------------------------------------

def check_loadable(store: CheckpointStore, suffix: str) -> None:
    """UserError unless `suffix` names a complete checkpoint; lists the ones that exist."""
    if store.is_complete(suffix):
        return
    checkpoints = store.list_checkpoints()
    complete = [c.suffix for c in checkpoints if c.complete]
    nested = next((c.nested for c in checkpoints if c.suffix == suffix), ())
    if nested:  # a prefix above checkpoints, not one that did not finish
        names = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")
        raise UserError(f"suffix={suffix}: not a checkpoint but a prefix holding {len(nested)} "
                        f"checkpoint(s) below it ({names}); load one with the storage location "
                        f"{store.location(suffix)} and its suffix=NAME")
    claimed_by = _claimed_by(store, suffix) if store.has_objects(suffix) else ""
    if claimed_by:  # a save's claim and no .metadata: that save is writing it, or ended early
        raise UserError(f"suffix={suffix}: checkpoint is incomplete (no .metadata yet) and claimed "
                        f"by a save{claimed_by}: that save is still writing it (load it once "
                        "that run ends), or it ended before it finished (`dcp-fsdp list` shows "
                        "its age; `dcp-fsdp delete` removes it)")
    state = ("is incomplete (no .metadata: the save did not finish)"
             if store.has_objects(suffix) else "does not exist")
    listing = ", ".join(complete[-10:]) if complete else "none"
    raise UserError(f"suffix={suffix}: checkpoint {state} under {store.location('')}; "
                    f"complete checkpoints there: {listing}")


# -- the manifest ------------------------------------------------------------------------

def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest).encode()


def read_manifest(store: CheckpointStore, suffix: str) -> dict[str, Any] | None:
    """The checkpoint's manifest; None only when none is stored. A stored one that is not a
    JSON object is refused (UserError): it does not mean "nothing to verify against"."""
    data = store.get_small(suffix, MANIFEST_NAME, MAX_MANIFEST_BYTES + 1)
    if data is None:
        return None
    parsed = _plain_object(data) if len(data) <= MAX_MANIFEST_BYTES else None
    if parsed is None:
        raise UserError(f"suffix={suffix}: its manifest {MANIFEST_NAME} is damaged (not a JSON "
                        f"object of plain values, at most {MAX_MANIFEST_BYTES // 1024} KiB), so "
                        "the values it was saved with are unknown and a load cannot be "
                        "verified; load with integrity=false to load it unverified, or save it "
                        "again")
    return parsed


def manifest_if_readable(store: CheckpointStore, suffix: str) -> dict[str, Any] | None:
    """The manifest for what it can say (settings in an error line); None if absent or damaged."""
    try:
        return read_manifest(store, suffix)
    except UserError:
        return None


# -- .metadata: read once per run, always through the screen -------------------------------

def metadata_facts(store: CheckpointStore, suffix: str) -> MetadataFacts:
    """What checkpoint `suffix`'s `.metadata` holds, screened: the launcher's reading when it
    handed one over for this suffix (contract.METADATA_FACTS_ENV), else one GET here."""
    handed = handed_metadata_facts(suffix)
    if handed is not None:
        return handed
    raw = store.get_small(suffix, METADATA_NAME, MAX_METADATA_BYTES + 1)
    if raw is None:
        raise UserError(f"suffix={suffix}: {METADATA_NAME} could not be read (removed, or not "
                        "readable with these credentials); the checkpoint was not loaded")
    return read_facts(raw, f"suffix={suffix}: {METADATA_NAME}")


def handed_metadata_facts(suffix: str) -> MetadataFacts | None:
    path = os.environ.get(contract.METADATA_FACTS_ENV)
    if not path:
        return None
    try:
        payload = json.loads(Path(path).read_text())
        return MetadataFacts.from_json(payload["facts"]) if payload.get("suffix") == suffix else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: read it again, screened


def write_metadata_facts(path: Path, suffix: str, facts: MetadataFacts) -> None:
    path.write_text(json.dumps({"suffix": suffix, "facts": facts.to_json()}))


def check_mirrorable(facts: MetadataFacts, world_size: int, suffix: str) -> None:
    """The raw ceiling mirrors each saving rank's objects on the rank of the same number: a
    resharded load cannot be mirrored. Refused (UserError) before any timing."""
    saved = facts.saving_world_size
    if saved and saved != world_size:
        raise UserError(
            f"ceiling=true: suffix={suffix} was saved by {saved} rank(s) and this run has "
            f"{world_size}; the raw ceiling mirrors the saving ranks' objects rank for rank, so "
            f"it cannot stand for a resharded load: drop ceiling=true, or load with {saved} ranks")


def check_replicas_mirrorable(manifest: dict[str, Any] | None, replicas: int, suffix: str) -> None:
    """With model.replicas=R the raw GET reads the files each shard's ranks wrote: only for a
    checkpoint saved on the same mesh (its manifest says). Refused (UserError) otherwise."""
    saved = (manifest or {}).get("replicas")
    if saved != replicas:
        said = f"was saved with model.replicas={saved}" if saved is not None else \
            "has no manifest naming its model.replicas"
        raise UserError(
            f"ceiling=true: suffix={suffix} {said} and this run has model.replicas={replicas}; "
            "the raw ceiling reads the files each shard's ranks wrote, which depends on the "
            f"saving mesh: drop ceiling=true, or load with model.replicas={saved or 1}")


def check_objects_whole(store: CheckpointStore, suffix: str, facts: MetadataFacts,
                        prefix_strategy: str) -> None:
    """Every data object `.metadata` names is there and long enough (prefix_strategy=default),
    else refused before any rank reads, where DCP would fail part way."""
    if prefix_strategy != "default" or not facts.object_sizes:
        return
    damage = objects_damage(facts, store.object_sizes(suffix))
    if damage is not None:
        raise UserError(f"suffix={suffix}: damaged checkpoint: {damage}; it cannot load: save it "
                        f"again, or load another suffix ({store.location(suffix)})")


def objects_damage(facts: MetadataFacts, stored: dict[str, int]) -> str | None:
    """'data object X is missing' (or holds fewer bytes than `.metadata` places in it), with
    how many more are damaged; None when every object `facts` names is whole in `stored`."""
    missing = sorted(name for name in facts.object_sizes if name not in stored)
    short = sorted(name for name, size in facts.object_sizes.items()
                   if name in stored and stored[name] < size)
    if not (missing or short):
        return None
    name = (missing or short)[0]
    what = ("is missing" if missing else
            f"holds {stored[name]} of the {facts.object_sizes[name]} bytes .metadata places in it")
    more = len(missing) + len(short) - 1
    return f"data object {name} {what}" + (f" (and {more} more object(s) damaged)" if more else "")


def checkpoint_damage(store: CheckpointStore, suffix: str,
                      only_msc: set[str] | None = None) -> str | None:
    """`list --check`: what is wrong with the complete checkpoint `suffix`, None when whole; one
    only storage.client=msc can load goes into `only_msc`."""
    try:
        raw = store.get_small(suffix, METADATA_NAME, MAX_METADATA_BYTES + 1)
        if raw is None:
            return f"{METADATA_NAME} is gone (removed since it was listed)"
        facts = read_facts(raw, f"{METADATA_NAME}")
        if facts.msc_paths and only_msc is not None:
            only_msc.add(suffix)
        # a data object that is not a file (fs: a FIFO, a link to /dev/zero) is refused too
        return objects_damage(facts, store.object_sizes(suffix)) if facts.object_sizes else None
    except UserError as refused:  # not a file (a FIFO); MetadataRefused: hostile, not DCP's
        return str(refused)


def extra_model_tensor(stored: dict[str, Any], expected: Any) -> str | None:
    """The first model tensor of the checkpoint (`stored`) the expected keys lack, said, or
    None: a load would leave it unread and report the rest as the checkpoint's load."""
    extra = [key for key in stored if key.startswith("model.") and key not in expected]
    if not extra:
        return None
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    return f"it holds tensor '{extra[0]}'{more}, which this model has not"
