"""Grouping runs' samples into the report's tables (DataFrames of raw numbers). Groups: the
FIXED_KEYS and every setting or RUN_ATTRIBUTES entry that differs between the runs that enter
the figures (docs/report.md)."""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

import pandas as pd

from dcp_fsdp.analysis.clients import client_notes, fill_missing_client, with_client_ratio
from dcp_fsdp.telemetry import time_split
from dcp_fsdp.telemetry.figures import NOISY_SPREAD, NOISY_WORDS
from dcp_fsdp.analysis.metrics import per_operation, samples_frame
from dcp_fsdp.analysis.run_summary import stager_note
from dcp_fsdp.analysis.sources import COMMAND_OPS, incomplete_runs
from dcp_fsdp.analysis.tables import ordered, phase_row, throughput_row, type_rows

FIXED_KEYS = ["nodes", "ranks", "model", "op", "storage"]
# An operation's order in its process: "first" (iteration 1: cold, as a restart's load) or
# "later" (warm, as a long run's periodic save); docs/metrics.md.
FIRST, LATER = "first", "later"
# Settings never used to split groups: they name places or runs, or change what the tool
# prints or keeps, not how a save or load behaves (request_stats does: its log costs time).
NOT_SETTINGS = {
    "command", "suffix", "results_dir", "nproc", "iterations", "seed", "op_timeout_s",
    "collective_timeout_s", "model.preset", "storage.kind", "storage.uri", "storage.endpoint",
    "storage.path", "storage.region", "storage.connect_timeout_s", "storage.metrics_url",
    "keep_request_log", "progress", "progress_interval_s", "ceiling", "tune.budget_s",
    "tune.trials", "tune.repeats",
}


# Settings that change only some operations: elsewhere they do not split rows. A name ending
# in "." covers its group. (storage.part_size_mib cuts a load's ranged GETs too: not here.)
APPLIES_TO = {
    "save_mode": ("save",), "async_save.": ("save",), "train_step_s": ("save",),
    "storage.reader": ("load",), "model.replica_load": ("load",),
}


def _applies(key: str, op: str) -> bool:
    for name, ops in APPLIES_TO.items():
        if key == name or (name.endswith(".") and key.startswith(name)):
            return op in ops
    return True


def _device(run: dict[str, Any]) -> str | None:
    """cpu, cuda, or cuda with its GPU model: runs on different GPUs stay apart."""
    model = (run["gpus"] or {}).get("model")
    return f"{run['device']} ({model})" if run["device"] and model else run["device"]


# What a run record says about where and with what it ran: these split groups, like a
# setting, whenever they differ between the runs.
RUN_ATTRIBUTES = {
    "torch": lambda run: run["versions"].get("torch"),
    "connector": lambda run: run["versions"].get("s3torchconnector"),
    "process_group": lambda run: run["backend"],
    # a forked rank's timings (the test suite's switch) are not a user's: never pooled
    "rank_start": lambda run: run["rank_start"],
    "device": _device,
}


def fork_note(rank_starts: Iterable[object]) -> str | None:
    """The caution when any run's ranks were forked (rank_start=fork): they share a server's pages."""
    forked = sum(start == "fork" for start in rank_starts)
    if not forked:
        return None
    return (f"{forked} run(s) with forked ranks (rank_start=fork: the test suite's "
            "DCP_FSDP_TEST_ONLY_FORK_RANKS=1, not the process a user runs): their timings are "
            "not a user's; they are never pooled with exec'd runs (column rank_start)")


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, into)
    else:
        into[prefix] = json.dumps(value) if isinstance(value, list) else value


def storage_label(run: dict[str, Any]) -> str:
    storage = run["storage"] or {}
    config = run["config"].get("storage") or {}
    kind = storage.get("kind") or config.get("kind") or "?"
    if kind != "s3":
        return kind
    if storage.get("embedded"):
        return "s3 (embedded SeaweedFS)"
    endpoint = storage.get("endpoint") or config.get("endpoint")
    if endpoint:
        host = endpoint.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        return f"s3 ({host})"
    return f"s3 (AWS {storage.get('region') or config.get('region') or ''})".replace(" )", ")")


def _untimed_count(summary: dict[str, Any] | None) -> int | None:
    """Requests outside the timed regions: the connector's plus boto3 control-plane calls."""
    if not summary:
        return None
    control = sum(n for per_status in (summary.get("control_plane") or {}).values()
                  for n in per_status.values())
    return (summary.get("count") or 0) + control


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def runs_frame(runs: list[dict[str, Any]], incomplete: dict[str, str]
               ) -> tuple[pd.DataFrame, list[str]]:
    """One row per run with the group columns, and the settings that differ between the runs
    with status ok. `incomplete` ({run_id: reason}): status "incomplete"; `matches_constants`:
    a run agrees with the ok runs on every setting they share (a failed run counts only so)."""
    rows, settings_per_run = [], []
    for run in runs:
        settings: dict[str, Any] = {}
        _flatten("", run["config"], settings)
        for name, attribute in RUN_ATTRIBUTES.items():
            if attribute(run) is not None:  # older records: unknown does not split
                settings[name] = attribute(run)
        settings_per_run.append(settings)
        reason = incomplete.get(run["run_id"]) if run["status"] == "ok" else None
        rows.append({
            "run_id": run["run_id"],
            "status": "incomplete" if reason else run["status"],
            "error": reason or run["error"],
            "command": run["command"],
            "started_at": run["started_at"],
            "nodes": run["node_count"],
            "ranks": run["world_size"],
            "model": (run["model"] or {}).get("preset") or (run["config"].get("model") or {}).get("preset"),
            "storage": storage_label(run),
            "untimed_requests": _untimed_count(run["untimed_requests"]),
            "clock_spread_s": run["clock_spread_s"],
            "protocol": run["config"].get("protocol"),  # protocol=mlperf: render's MLPerf lines
        })
    fill_missing_client(settings_per_run)  # records from before storage.client: the connector
    included = [s for s, row in zip(settings_per_run, rows) if row["status"] == "ok"]
    varying, constants = [], {}
    keys = sorted({key for settings in included for key in settings} - NOT_SETTINGS)
    for key in keys:
        # a setting older records lack does not split groups by itself
        values = {_text(s[key]) for s in included if key in s}
        if len(values) > 1:
            varying.append(key)
        elif values:
            constants[key] = values.pop()
    frame = pd.DataFrame(rows)
    for key in varying:
        frame[key] = [("" if key not in s else
                       str(s[key]).lower() if isinstance(s[key], bool) else str(s[key]))
                      for s in settings_per_run]
    frame["matches_constants"] = [all(key not in s or _text(s[key]) == value
                                      for key, value in constants.items())
                                  for s in settings_per_run]
    return frame, varying


def _with_settings(frame: pd.DataFrame, run_rows: pd.DataFrame, group_keys: list[str],
                   varying: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(samples, operations) with their runs' settings (blank where one does not apply to the op)."""
    attributes = run_rows[["run_id", *[k for k in group_keys if k != "op"]]]
    # a setting named like a sample field (save_mode): the run's setting groups
    frame = frame.drop(columns=[k for k in attributes if k != "run_id" and k in frame])
    frame = frame.merge(attributes, on="run_id", how="left")
    ops = per_operation(frame).merge(attributes, on="run_id", how="left")
    for table in (frame, ops):
        table["op_order"] = [FIRST if int(i) == 1 else LATER for i in table["iteration"]]
        for key in group_keys:
            table[key] = table[key].astype(object).where(table[key].notna(), "")
        for key in varying:  # a setting that does not apply to an op: blank, one row
            table.loc[[not _applies(key, op) for op in table["op"]], key] = ""
    return frame, ops


# A run's wall-clock spread worth a note: 1 % of an operation's span.
SKEW_NOTED_SHARE = 0.01


def skew_notes(run_rows: pd.DataFrame, ops: pd.DataFrame) -> list[str]:
    """Runs on more than one node whose wall clocks read far enough apart (clock_spread_s)
    to move their spans (aggregate MiB/s subtracts clocks of different hosts)."""
    notes = []
    for _, run in run_rows.iterrows():
        spread_s = run.get("clock_spread_s")
        if not isinstance(spread_s, (int, float)) or not (run.get("nodes") or 0) > 1:
            continue
        spans = ops.loc[ops["run_id"] == run["run_id"], "span_s"].astype(float)
        if len(spans) and spread_s > SKEW_NOTED_SHARE * spans.min():
            notes.append(f"run {run['run_id']}: its nodes' wall clocks read up to {spread_s * 1e3:.0f} ms "
                         f"apart, {100 * spread_s / spans.min():.0f} % of its shortest span; its "
                         "aggregate MiB/s carries that skew, its slowest-rank MiB/s does not")
    return notes


def _failed_like(failed_runs: pd.DataFrame, labels: dict[str, Any], varying: list[str]) -> float:
    """Failed runs that would have made a row of this group (its op's commands, its settings)."""
    same_group = failed_runs
    for name in ("nodes", "ranks", "model", "storage", *varying):
        if _applies(name, labels["op"]):
            same_group = same_group[same_group[name].astype(str) == str(labels[name])]
    commands = [command for command, ops in COMMAND_OPS.items() if labels["op"] in ops]
    return len(same_group[same_group["command"].isin(commands)]) if commands else math.nan


def build(runs: list[dict], samples: list[dict]) -> dict[str, Any]:
    """Every table the report prints, as DataFrames of raw numbers."""
    run_rows, varying = runs_frame(runs, incomplete_runs(runs, samples))
    group_keys = FIXED_KEYS + varying
    ok_ids = set(run_rows.loc[run_rows["status"] == "ok", "run_id"])
    ok_samples = [s for s in samples if s["run_id"] in ok_ids]
    empty = pd.DataFrame()
    not_ok = run_rows[run_rows["status"] != "ok"]
    result: dict[str, Any] = {"group_keys": group_keys, "varying": varying, "runs": run_rows,
                              "notes": [], "throughput": empty, "phases": empty, "types": empty,
                              "samples": empty, "operations": empty, "splits": [], "not_ok": not_ok}
    if note := fork_note(run["rank_start"] for run in runs if run["run_id"] in ok_ids):
        result["notes"].append(note)
    if not ok_samples:
        return result
    frame, ops = _with_settings(samples_frame(ok_samples), run_rows, group_keys, varying)
    result["samples"], result["operations"] = frame, ops
    throughput, phases, types, splits = [], [], [], []
    failed_runs = not_ok[(not_ok["status"] != "incomplete") & not_ok["matches_constants"]]
    samples_of = dict(list(frame.groupby(group_keys, sort=False, dropna=False)))
    for group_key, group_ops in ops.groupby(group_keys, sort=True, dropna=False):
        labels: dict[str, Any] = dict(zip(group_keys, group_key))  # op text, nodes int, ...
        group_samples = samples_of[group_key]
        untimed = run_rows.loc[run_rows["run_id"].isin(set(group_ops["run_id"])),
                               "untimed_requests"].astype(float)
        failed = _failed_like(failed_runs, labels, varying)
        throughput.append(throughput_row(labels, group_ops, group_samples, untimed, failed, ops))
        phases.append(phase_row(labels, group_samples, group_ops))
        types.extend(type_rows(labels, group_samples, len(group_ops)))
        splits += [(labels, line) for line in time_split.split_lines(group_samples)]
    result["throughput"], single_notes = with_client_ratio(
        ordered(pd.DataFrame(throughput), group_keys), group_keys)
    result["notes"] += client_notes([run for run in runs if run["run_id"] in ok_ids]) + single_notes
    noisy = int(result["throughput"]["spread"].gt(NOISY_SPREAD).sum())
    if noisy:
        result["notes"] += [f"{noisy} group(s) marked noisy: their iterations' {NOISY_WORDS}. "
                           "Differences smaller than the spread are not a result."]
    result["notes"] += skew_notes(run_rows, ops)
    if "stager_renewed" in frame and (note := stager_note(frame["stager_renewed"])):
        result["notes"].append(note)
    result["phases"] = ordered(pd.DataFrame(phases), group_keys)
    result["types"] = ordered(pd.DataFrame(types), group_keys)
    result["splits"] = splits
    return result
