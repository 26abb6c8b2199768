"""`dcp-fsdp list`: the checkpoints under storage.uri / storage.path, complete or not, and
the multipart uploads left open there; `dcp-fsdp clean-uploads`: abort those uploads."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from dcp_fsdp import log
from dcp_fsdp.log import printable
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.config.arguments import CLEAN_UPLOADS_MIN_AGE_S as DEFAULT_MIN_AGE_S
from dcp_fsdp.config.validate import suffix_taken
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.aftermath import uploads_words
from dcp_fsdp.launch.preflight import check_fs_root, needs_embedded_server
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.storage.layout import CheckpointInfo, OpenUpload, read_claim

if TYPE_CHECKING:
    from dcp_fsdp.storage.base import CheckpointStore


def _store(cfg: BenchmarkConfig, command: str) -> CheckpointStore:
    if needs_embedded_server(cfg):
        raise UserError(f"storage.uri is not set: give the location to {command}, e.g. "
                        "storage.uri=s3://my-bucket/ckpt (or storage=fs storage.path=DIR)")
    if cfg.storage.kind == StorageKind.fs:
        check_fs_root(cfg.storage.path, must_exist=True)  # list reads: it creates nothing
    store = make_store(cfg.storage)
    if cfg.storage.kind != StorageKind.fs:  # fs: listing needs no write access
        store.preflight()
    return store


def list_checkpoints(cfg: BenchmarkConfig, check: bool = False) -> int:
    """The table of suffixes and the open uploads; `check` (`list --check`): each complete
    checkpoint's objects against its `.metadata` too. Exit 1 when one is damaged."""
    store = _store(cfg, "list")
    checkpoints = store.list_checkpoints()
    damage = _damage(store, cfg, checkpoints) if check else {}
    uploads = store.open_uploads()
    by_suffix: dict[str, list[OpenUpload]] = {}
    for upload in uploads:
        by_suffix.setdefault(upload.suffix, []).append(upload)
    rows = [[c.suffix, "DAMAGED" if c.suffix in damage else _state(c, c.suffix in by_suffix),
             f"{c.size_bytes / 2**20:.1f}", c.object_count, c.modified] for c in checkpoints]
    print(printable(f"checkpoints under {store.location('')}"))
    print(_table(rows, ["suffix", "state", "MiB", "objects", "modified (UTC)"]))
    if not check and any(c.complete for c in checkpoints):
        print("complete: its .metadata is stored (DCP's commit); `dcp-fsdp list --check` also "
              "checks each one's data objects against it (a deleted or cut-short object)")
    for suffix, what in damage.items():
        print(printable(f"suffix={suffix}: damaged checkpoint: {what}; it cannot load: save it "
                        f"again, or `dcp-fsdp delete suffix={suffix}`"))
    for prefix in (c for c in checkpoints if c.nested):
        print(printable(f"{_prefix_words(prefix)}`dcp-fsdp list {_where_setting(store, prefix.suffix)}` "
                        "lists them"))
    for claim in (c for c in checkpoints if c.claim_only):
        print(printable(_abandoned_claim_note(store, claim, by_suffix.get(claim.suffix, []))))
    for untaken in (c for c in checkpoints if c.complete and not suffix_taken(c.suffix)):
        print(printable(f"suffix={untaken.suffix}: complete, but not a name `load` and `delete` "
                        "take (a suffix starts with an ASCII letter or digit, then letters, "
                        "digits, '.', '_' and '-'): rename it to load it with this tool, or "
                        "load it with torch's dcp.load"))
    if uploads:
        rows = [[suffix or "(root)", len(group), sum(u.part_count for u in group),
                 f"{sum(u.size_bytes for u in group) / 2**20:.1f}",
                 min(u.initiated for u in group)] for suffix, group in sorted(by_suffix.items())]
        print()
        print("open multipart uploads (stored and billed until aborted; "
              "`dcp-fsdp clean-uploads` with the same storage settings aborts them)")
        print(_table(rows, ["suffix", "uploads", "parts", "MiB", "oldest (UTC)"]))
    return 1 if damage else 0


def _table(rows: list[list], headers: list[str]) -> str:
    """Rows as a table, every cell printable (a key from storage may hold a newline or ESC)."""
    from tabulate import tabulate

    return tabulate([[printable(c) if isinstance(c, str) else c for c in row] for row in rows],
                    headers=headers, tablefmt="github")


def _damage(store: CheckpointStore, cfg: BenchmarkConfig,
            checkpoints: list[CheckpointInfo]) -> dict[str, str]:
    """{suffix: what is wrong} of the complete checkpoints whose objects do not match their
    `.metadata` (read once each, screened); said in one line how many were checked."""
    complete = [c.suffix for c in checkpoints if c.complete]
    strategy = cfg.storage.prefix_strategy.value
    if strategy != "default":  # the objects lie under prefixes of their own, not the suffix
        log.info(f"--check: storage.prefix_strategy={strategy} puts the data objects outside "
                 "the suffixes; not checked (a load checks them)")
        return {}
    only_msc: set[str] = set()
    found = {suffix: what for suffix in complete
             if (what := layout.checkpoint_damage(store, suffix, only_msc)) is not None}
    log.info(f"--check: {len(complete)} complete checkpoint(s) checked against their "
             f".metadata: {len(found)} damaged")
    for suffix in sorted(only_msc):  # whole, but not for every client
        log.info(f"--check: suffix={suffix} was written by storage.client=msc (its .metadata "
                 "holds multi-storage-client path objects): only storage.client=msc loads it")
    return found


def _state(info: CheckpointInfo, uploading: bool) -> str:
    """`uploading`: multipart uploads are open under the suffix."""
    if info.complete:
        state = "complete" if suffix_taken(info.suffix) else "complete; NAME NOT TAKEN"
    elif info.claim_only:  # parts in open uploads are data, just not committed objects
        what = "UPLOADS OPEN, NOTHING COMMITTED" if uploading else "NO DATA"
        state = f"CLAIMED, {what} ({_age(_age_s(info))} old)"
    else:
        state = "INCOMPLETE"
    if not info.nested:
        return state
    above = f"PREFIX OF {len(info.nested)} CHECKPOINT(S)"
    return f"{state}; {above}" if info.own_object_count else above


def _age_s(info: CheckpointInfo) -> float:
    """Seconds since the suffix's newest object was written (by the store's clock)."""
    modified = datetime.datetime.fromisoformat(info.modified)
    return max(0.0, (datetime.datetime.now(datetime.timezone.utc) - modified).total_seconds())


def _where_setting(store: CheckpointStore, suffix: str) -> str:
    """The storage setting that points a command at folder `suffix` itself."""
    return f"storage.{'path' if store.kind == 'fs' else 'uri'}={store.location(suffix)}"


def _prefix_words(info: CheckpointInfo, shown: int = 3) -> str:
    """The head of a line for a folder above other checkpoints: what it holds."""
    more = len(info.nested) - shown
    names = ", ".join(info.nested[:shown]) + (f" and {more} more" if more > 0 else "")
    return (f"suffix={info.suffix}: a prefix holding {len(info.nested)} checkpoint(s) in "
            f"folders below it ({names}), not one checkpoint; ")


def _abandoned_claim_note(store: CheckpointStore, info: CheckpointInfo, uploads: list[OpenUpload]) -> str:
    """A suffix holding only a save's claim: who claimed it, when, its open uploads, the fix."""
    claim = read_claim(store, info.suffix)
    who = (f" by run {claim.get('run_id') or '?'} on host {claim['host']}"
           if claim.get("host") else "")
    age_s = _age_s(info)
    young = age_s < DEFAULT_MIN_AGE_S
    delete = (f"`dcp-fsdp delete suffix={info.suffix}{' --force' if young else ''}` with the "
              "same storage settings")
    why = (f" (--force: it is younger than {_age(DEFAULT_MIN_AGE_S)}, below which delete "
           "leaves a suffix alone)" if young else "")
    if uploads:
        return (f"suffix={info.suffix}: claimed {_age(age_s)} ago{who}; no object was committed, "
                f"but {uploads_words(uploads)} are open there, stored and billed until aborted: "
                "a save that ended mid-upload, unless a save is writing there now; "
                f"{delete} aborts them and removes the claim{why}")
    return (f"suffix={info.suffix}: claimed {_age(age_s)} ago{who} and holds no data: an "
            "abandoned claim (a save that ended before writing), unless a save is starting "
            f"there now; {delete} removes it{why}")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def clean_uploads(cfg: BenchmarkConfig, min_age_s: float = DEFAULT_MIN_AGE_S) -> int:
    """Abort the open multipart uploads under the location (suffix=: that checkpoint's) at least
    `min_age_s` old (a younger one may be a running save's), each listed with its age."""
    store = _store(cfg, "clean")
    uploads = store.open_uploads(cfg.suffix)
    where = store.location(cfg.suffix or "")
    # one moment for the table and the abort: else an upload listed as "leave" may be aborted
    now = datetime.datetime.now(datetime.timezone.utc)
    old = [u for u in uploads if u.age_s(now) >= min_age_s]
    young = [u for u in uploads if u not in old]
    if uploads:
        rows = [[u.suffix or "(root)", u.key.rsplit("/", 1)[-1], _age(u.age_s(now)), u.part_count,
                 f"{u.size_bytes / 2**20:.1f}",
                 "abort" if u in old else f"leave (younger than {_age(min_age_s)})"]
                for u in uploads]
        print(printable(f"open multipart uploads under {where}"))
        print(_table(rows, ["suffix", "object", "age", "parts", "MiB", "action"]))
    aborted = store.abort_uploads(cfg.suffix, min_age_s, now)
    size_mib = sum(u.size_bytes for u in old) / 2**20
    log.info(f"aborted {aborted} open multipart upload(s) under {where} "
             f"({sum(u.part_count for u in old)} parts, {size_mib:.1f} MiB)")
    if young:
        log.info(f"left {len(young)} upload(s) younger than {_age(min_age_s)} alone: a save may "
                 "still be writing them (--min-age-s SECONDS or --force to abort them too)")
    return 0


def delete_checkpoint(cfg: BenchmarkConfig, min_age_s: float = DEFAULT_MIN_AGE_S) -> int:
    """Remove checkpoint `suffix=`, every object of it and its open uploads: a complete one,
    or an incomplete one whose newest object is at least `min_age_s` old (a younger one may
    be a save writing there now). Never a prefix above other checkpoints."""
    if not cfg.suffix:
        raise UserError("delete needs suffix=NAME: the checkpoint to remove (`dcp-fsdp list` "
                        "with the same storage settings shows them)")
    store = _store(cfg, "delete")
    suffix, where = cfg.suffix, store.location(cfg.suffix)
    found = next(iter(store.list_checkpoints(suffix)), None)
    uploads = store.open_uploads(suffix)
    if found is None and not uploads:
        raise UserError(f"suffix={suffix}: nothing is stored at {where}; `dcp-fsdp list` with "
                        "the same storage settings shows the checkpoints there")
    if found is not None and found.nested and not found.recognised:  # never a prefix above others
        raise UserError(f"{_prefix_words(found)}left alone: delete each with `dcp-fsdp delete "
                        f"{_where_setting(store, found.suffix)} suffix=NAME`")
    if found is not None and not found.recognised:  # not one checkpoint of ours
        raise UserError(f"suffix={found.suffix}: holds objects only in folders below it, none of its "
                        "own, so it is not a checkpoint this tool can recognise; left alone (remove "
                        "it with your storage's own tools if it is not needed)")
    if found is not None and not found.complete and _age_s(found) < min_age_s:
        what = "holds only a save's claim" if found.claim_only else "is incomplete"
        raise UserError(f"suffix={suffix}: {what}, written {_age(_age_s(found))} ago: a save may "
                        f"be writing there now; left alone (it can be removed once older than "
                        f"{_age(min_age_s)}; --force removes it now)")
    aborted = store.abort_uploads(suffix)
    store.delete(suffix)
    state = ("no objects" if found is None else "complete" if found.complete else
             "a claim with no data" if found.claim_only else "incomplete")
    size = "" if found is None else (f", {found.object_count} object(s), "
                                     f"{found.size_bytes / 2**20:.1f} MiB")
    log.info(f"deleted suffix={suffix} at {where} ({state}{size}"
             + (f"; {aborted} open multipart upload(s) aborted" if aborted else "") + ")")
    return 0
