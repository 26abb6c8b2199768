"""After the ranks have ended: a record that says how (from torch's agent's report when rank 0
wrote none; corrected where only the parent knows a signal came from outside), the user's one
line, and nothing left billed: a save cut short is named with its state, its uploads aborted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dcp_fsdp.process import lifeline
from dcp_fsdp.process.environ import environment
from dcp_fsdp import contract, log
from dcp_fsdp.config.schema import BenchmarkConfig
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.storage.base import ceiling_token
from dcp_fsdp.telemetry.results_dir import fallback_results_dir, write_record
from dcp_fsdp.telemetry import records

if TYPE_CHECKING:
    from dcp_fsdp.storage.base import CheckpointStore, OpenUpload


@dataclass
class RanksOutcome:
    """How a launch of the ranks ended, as the parent saw it."""

    exit_code: int
    status: str  # ok | failed | interrupted
    error: str | None = None  # one line: the rank that ended first and why
    writing_suffix: str | None = None  # the suffix a save was writing when the run ended
    failures: dict[str, dict] = field(default_factory=dict)  # torchrun's, per global rank
    cause: contract.EndCause = contract.EndCause.AGENT  # why, as a field (never read from `error`)


def find_record(results_dir: str, run_id: str) -> Path | None:
    paths = [records.record_path(where, run_id) for where in (results_dir, str(fallback_results_dir()))]
    return next((path for path in paths if path.exists()), None)


def settle(cfg: BenchmarkConfig, run_id: str, outcome: "RanksOutcome",
           env: dict[str, str] | None = None, claimed: list[str] | None = None) -> None:
    """Record, say and clean up after a failed launch; `claimed`: the suffixes claimed before it."""
    if outcome.status == "ok":
        return
    lifeline.remove_stale()  # a killed rank's request-log directory
    path = find_record(cfg.results_dir, run_id)
    rank_wrote = path is not None
    if path is None:
        run = records.RunRecord(
            run_id=run_id, command=cfg.command.value, argv=records.command_line(),
            status=outcome.status, error=outcome.error, finished_at=records.utc_now(),
            config=records.config_for_record(cfg), world_size=cfg.nproc,
            versions=records.versions(), slurm=records.slurm_environment(),
            incomplete_suffix=outcome.writing_suffix,
            rank_failures={rank: records.RankFailure.model_validate(failure)
                           for rank, failure in outcome.failures.items()},
            end_cause=outcome.cause.value)
        path = write_record(cfg.results_dir, run, [])
        log.info(f"record: {path} ({outcome.status})")
    run_line, replaced_root_cause = _amend(path, outcome)
    if outcome.status == "interrupted":
        log.error("interrupted")
    elif outcome.error and (not rank_wrote or outcome.cause is contract.EndCause.KILLED
                            or replaced_root_cause):
        log.error(outcome.error)  # no rank said it: it was killed, or never got going
    _partial_checkpoints(cfg, run_line, env or {}, claimed or [])
    if cfg.ceiling or cfg.command.value == "ceiling":
        _ceiling_leftovers(cfg, run_id, env or {})


def _ceiling_leftovers(cfg: BenchmarkConfig, run_id: str, env: dict[str, str]) -> None:
    """Remove what a run stopped in its ceiling rounds left in its raw areas (rank/ceiling.py)."""
    if os.environ.get(contract.EMBEDDED_ENV) == "1" or env.get(contract.EMBEDDED_ENV) == "1":
        return  # deleted with the embedded server
    token = ceiling_token(run_id)
    with environment({k: v for k, v in env.items() if k.startswith("AWS_")}):
        try:
            store = make_store(cfg.storage, after_failure=True)  # a stalled server: seconds
            aborted = sum(store.clean_raw_area(area) for area in (token, f"files-{token}"))
        except Exception as error:  # cleanup: the run's outcome stands, say what is left
            log.warning(f"could not remove the ceiling's objects of this run ({error}); "
                        "`dcp-fsdp clean-uploads` aborts open uploads")
            return
    if aborted:
        log.info(f"ceiling: {aborted} open multipart upload(s) of this run's raw rounds aborted")


def _amend(path: Path, outcome: "RanksOutcome") -> tuple[dict, bool]:
    """(the run line, whether the parent's cause replaced the rank's), its status made the
    parent's where they differ: a rank stopped by the agent after a peer died cannot always
    tell that from an interrupt."""
    lines = path.read_text().splitlines()
    run_line = json.loads(lines[0])
    before = dict(run_line)
    replaced = False
    if outcome.status == "interrupted" and run_line.get("error") != outcome.error:
        # Only the parent knows a signal came from outside: a rank stuck in a collective
        # handles it late, when its peers are already gone, and may call it a failure.
        run_line.update(status=outcome.status, error=outcome.error, end_cause=outcome.cause.value)
    else:
        # The rank that recorded was stopped because another ended first, or failed because
        # a rank or a node's agent was killed (its I/O cut short): the kill, or that rank's
        # own line (its error file), is the root cause; what the ranks said is kept.
        peer_ended = run_line.get("end_cause") == contract.EndCause.PEER_ENDED.value
        replaced = bool(outcome.status == "failed" and outcome.error and (
            peer_ended or (outcome.cause is contract.EndCause.KILLED
                           and run_line.get("end_cause") != contract.EndCause.KILLED.value)))
        if replaced or run_line.get("status") not in (outcome.status, "ok"):
            rank_said = run_line.get("error")
            keep = rank_said and rank_said != outcome.error and not (replaced and peer_ended)
            run_line.update(status=outcome.status, error=(
                f"{outcome.error}; the ranks recorded: {rank_said}" if keep else outcome.error),
                end_cause=outcome.cause.value)
    if outcome.failures and not run_line.get("rank_failures"):
        run_line["rank_failures"] = outcome.failures
    if outcome.writing_suffix and not run_line.get("incomplete_suffix"):
        run_line["incomplete_suffix"] = outcome.writing_suffix
    if run_line != before:
        replace_run_line(path, lines, run_line)
    return run_line, replaced


def lead_the_record(results_dir: str, run_id: str, line: str) -> None:
    """A cause only the launcher sees (its embedded server died): the run's last line, and the
    head of the record's error (what the ranks recorded kept after it)."""
    if (path := find_record(results_dir, run_id)) is not None:
        lines = path.read_text().splitlines()
        run_line = json.loads(lines[0])
        rank_said = run_line.get("error")
        run_line["error"] = f"{line}; the ranks recorded: {rank_said}" if rank_said else line
        replace_run_line(path, lines, run_line)
    log.error(line)


def replace_run_line(path: Path, lines: list[str], run_line: dict) -> None:
    """Record `path` (read as `lines`) with its first line replaced by `run_line`, atomically."""
    records.replace_atomically(path, lambda out: print(json.dumps(run_line), *lines[1:], sep="\n", file=out))


def _partial_checkpoints(cfg: BenchmarkConfig, run_line: dict, env: dict[str, str],
                         claimed: list[str]) -> None:
    """Name the checkpoint a stopped save left behind, and abort its open uploads."""
    # The save in progress, and the last one recorded (an async save returns before its
    # upload is committed); earlier ones were committed before the next began. The
    # launcher's claims of saves not reached hold no data: removed below.
    recorded = run_line.get("suffixes", [])
    candidates = [s for s in [run_line.get("incomplete_suffix"), *recorded[-1:],
                              *(c for c in claimed if c not in recorded)] if s]
    if not candidates or cfg.command.value == "load":
        return
    if os.environ.get(contract.EMBEDDED_ENV) == "1" or env.get(contract.EMBEDDED_ENV) == "1":
        log.info(f"partial checkpoint suffix={candidates[0]}: on the embedded S3 server, "
                 "deleted with it at exit")
        return
    with environment({k: v for k, v in env.items() if k.startswith("AWS_")}):
        try:
            store = make_store(cfg.storage, after_failure=True)  # a stalled server: seconds
            for suffix in dict.fromkeys(candidates):
                if not store.is_complete(suffix):
                    _settle_suffix(store, suffix, run_line.get("run_id"))
        except Exception as error:  # cleanup: the run's outcome stands, say what is left
            log.warning(f"could not check the partial checkpoint ({error}); `dcp-fsdp list` "
                        "shows it and its open uploads, `dcp-fsdp clean-uploads` aborts them")


def _settle_suffix(store: CheckpointStore, suffix: str, run_id: str | None) -> None:
    """A suffix a stopped save was writing: its uploads aborted, a bare claim removed, one line."""
    opened = store.open_uploads(suffix)
    store.abort_uploads(suffix)
    # an upload a rank started after the abort (still ending as it was stopped) is left
    # open: it must never be called "ended before writing", and the claim stays with it
    left = store.open_uploads(suffix)
    aborted = [u for u in opened if u.upload_id not in {u.upload_id for u in left}]
    location = store.location(suffix)
    if left:
        log.warning(f"partial checkpoint suffix={suffix} at {location}: "
                    f"{uploads_words(left)} still open after the abort (a rank still "
                    "writing as it stopped), stored and billed until aborted: `dcp-fsdp "
                    f"delete suffix={suffix} --force` with the same storage settings aborts "
                    "them and removes the checkpoint")
        return
    if layout.holds_only_claim_of(store, suffix, run_id):
        store.delete(suffix)  # a claim with no data is not a checkpoint
        if aborted:  # uploads were open: a save that ended mid-upload, not before writing
            log.info(f"partial checkpoint suffix={suffix} at {location}: a save that ended "
                     f"mid-upload (nothing committed; {uploads_words(aborted)}, aborted: no longer "
                     "stored or billed); it held only this run's claim otherwise: removed, the "
                     "suffix is free again")
        else:
            log.info(f"suffix={suffix} held only this run's claim, no data (the save ended before "
                     f"writing): removed from {location}")
        return
    state = ("incomplete: no .metadata, not loadable; remove it or keep it to inspect"
             if store.has_objects(suffix) else "nothing committed")
    uploads = f"; {uploads_words(aborted)} aborted" if aborted else ""
    log.info(f"partial checkpoint suffix={suffix} at {location} ({state}{uploads})")


def uploads_words(uploads: list[OpenUpload]) -> str:
    """"2 multipart upload(s) holding 31 part(s), 201.9 MiB"."""
    return (f"{len(uploads)} multipart upload(s) holding {sum(u.part_count for u in uploads)} "
            f"part(s), {sum(u.size_bytes for u in uploads) / 2**20:.1f} MiB")
