"""What `dcp-fsdp tune` says at the end: the table of settings tried, the verdict, the noise
seen, efficiency against the raw ceiling, and the OVERRIDES= line. `result_summary` turns a
search result into plain data (`tune.json`); `print_result` prints from that data alone.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from tabulate import tabulate

from dcp_fsdp.tune.search import (CEILING_ROUNDS, MIN_FINAL_SCORES, SearchResult, Trial, applies,
                                  settings_key)

RULE = (f"a setting is recommended only when each of its final scores (measured in rounds "
        f"beside the defaults) is above every final score of the defaults, with at least "
        f"{MIN_FINAL_SCORES} of each")


def override_line(settings: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in settings.items())


def _changed(settings: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if str(v) != str(defaults.get(k))}


def ceiling_summary(trial: Trial) -> dict[str, Any]:
    """The recommendation's efficiency trial: its DCP figures, its ceiling (the median raw
    round) and their ratio, per op; or why it has none."""
    figures = trial.figures
    found: dict[str, Any] = {"settings": trial.settings, "record": figures.get("record"),
                             "status": figures.get("status"), "error": figures.get("error"),
                             "wall_s": trial.wall_s}
    if trial.score is None:
        return found
    for op, raw in (("save", "raw_put"), ("load", "raw_get")):
        found.update({f"{op}_mib_s": figures.get(f"{op}_mib_s"),
                      f"{raw}_mib_s": figures.get(f"{raw}_median_mib_s",
                                                  figures.get(f"{raw}_best_mib_s")),
                      f"{raw}_spread": figures.get(f"{raw}_spread"),
                      f"{op}_efficiency": figures.get(f"{op}_efficiency")})
    return found


def result_summary(result: SearchResult, wall_s: float, session_dir: Path,
                   requires: dict[str, Any] | None = None) -> dict[str, Any]:
    finalist_keys = {settings_key(s) for s in result.finalists}
    ranking = []
    for ranked in result.ranking:
        ok = [t for t in ranked.trials if t.score is not None]
        ranking.append({
            "settings": ranked.settings, "finalist": settings_key(ranked.settings) in finalist_keys,
            "runs": len(ranked.trials), "ok": len(ok), "scores_mib_s": ranked.scores,
            "final_scores_mib_s": result.final_scores(ranked.settings),
            "save_mib_s": [t.figures.get("save_mib_s") for t in ok],
            "load_mib_s": [t.figures.get("load_mib_s") for t in ok]})
    return {
        "trials": [{"settings": t.settings, "role": t.role, "score_mib_s": t.score,
                    "wall_s": t.wall_s, **{k: v for k, v in t.figures.items()
                                          if k in ("save_mib_s", "load_mib_s", "record")}}
                   for t in result.trials],
        "defaults": result.defaults, "finalists": result.finalists,
        "searched": result.searched, "stopped": result.stopped, "ranking": ranking,
        "recommended": result.recommended, "best": result.best.settings,
        # what a run accepts: a setting without effect under the others left out
        "overrides": {k: v for k, v in result.best.settings.items()
                      if applies(k, result.best.settings, requires or {})},
        "gain": result.gain, "noise": result.noise, "rule": RULE,
        # the recommendation's efficiency trial, run after the verdict (its "trial": what
        # ceiling_summary found); {} while it has not run or when no time was left for it
        "ceiling": {},
        "wall_s": wall_s, "session_dir": str(session_dir)}


def _spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return (f"{min(values):.1f}/{statistics.median(values):.1f}/{max(values):.1f}"
            if values else "")


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    defaults = summary["defaults"]
    rows = {override_line(r["settings"]): r for r in summary["ranking"]}
    base = rows.get(override_line(defaults), {}).get("final_scores_mib_s", [])
    noise = summary["noise"]
    seen = (f"noise seen: the defaults' final scores spread {noise * 100:.0f} % "
            f"({min(base):.1f}..{max(base):.1f} MiB/s over {len(base)} rounds)"
            if noise is not None else "noise seen: unknown (fewer than "
            f"{MIN_FINAL_SCORES} final rounds; raise tune.budget_s)")
    chosen = summary["recommended"]
    if chosen is not None:
        scores = rows[override_line(chosen)]["final_scores_mib_s"]
        return [f"recommended: {override_line(_changed(chosen, defaults))} (its worst final "
                f"score {min(scores):.1f} MiB/s above the defaults' best {max(base):.1f}; "
                f"median gain {summary['gain'] * 100:+.1f} %)", seen, *_not_dcps(chosen)]
    others = [r for r in summary["ranking"] if r["finalist"] and r["final_scores_mib_s"]
              and override_line(r["settings"]) != override_line(defaults)]
    if len(base) < MIN_FINAL_SCORES:
        lines = [f"recommended: keep the defaults: {len(base)} final round(s), too few to tell "
                 "a setting from noise; raise tune.budget_s (or tune.trials, tune.repeats)",
                 seen]
    else:
        lines = ["recommended: keep the defaults: no setting beat them beyond the measured "
                 "spread (" + RULE + ")", seen]
    for row in others:
        scores = row["final_scores_mib_s"]
        lines.append(f"  candidate {override_line(_changed(row['settings'], defaults))}: final "
                     f"scores {min(scores):.1f}..{max(scores):.1f} MiB/s")
    return lines


def efficiency_lines(ceiling: dict[str, Any]) -> list[str]:
    """What the recommendation's efficiency trial found, or why there is none."""
    found = ceiling.get("trial")
    if not found:
        return ["efficiency against the ceiling: not measured (the budget had no time left "
                "for the recommendation's trial with ceiling=true; raise tune.budget_s)"]
    if found.get("save_mib_s") is None and found.get("load_mib_s") is None:
        return [f"efficiency against the ceiling: its trial failed ({found.get('error')}; "
                f"record {found.get('record')})"]
    parts, above = [], []
    for op, raw in (("save", "raw_put"), ("load", "raw_get")):
        dcp, best, ratio = found[f"{op}_mib_s"], found[f"{raw}_mib_s"], found[f"{op}_efficiency"]
        if dcp is None or not best or ratio is None or math.isnan(ratio):
            continue
        spread = found[f"{raw}_spread"]
        noise = "" if spread is None or math.isnan(spread) else f", raw rounds spread {spread * 100:.0f} %"
        parts.append(f"{op} {dcp:.1f} of {best:.1f} MiB/s ({ratio:.2f}{noise})")
        if ratio > 1:
            above.append(op)
    lines = ["efficiency of the recommendation against the ceiling (its own trial: "
             f"{CEILING_ROUNDS} save-and-load iterations, then a raw PUT/GET round of the same "
             "objects per iteration with the same client settings; the ceiling is the median raw "
             "round): " + ("; ".join(parts) or "no figures")]
    if above:
        lines.append(f"  above 1 ({', '.join(above)}): DCP beat the median raw round, so it is "
                     "no ceiling here (a stalled round, or too few); see the record")
    return lines


def _not_dcps(chosen: dict[str, Any]) -> list[str]:
    """A recommendation that holds the tool's own reader says that DCP's is not it."""
    read_ahead = chosen.get("storage.read_ahead")
    if not read_ahead or str(read_ahead) == "0":
        return []
    return [f"  storage.read_ahead={read_ahead} is the tool's reader, not DCP's: a training job "
            "gets its gain only with such a reader of its own (docs/headroom.md)"]


def malloc_lines(found: dict[str, Any]) -> list[str]:
    """What the paired malloc launches found (launch/tune.py), or why there were none."""
    status = found.get("status")
    if status == "no_room":
        return [f"malloc: not measured: its paired launches ({MIN_FINAL_SCORES} rounds of "
                f"malloc=default and malloc=raised, about {found['launch_s']:.0f} s a launch) "
                f"need about {found['needed_s']:.0f} s, the budget had {found['left_s']:.0f} s "
                f"left; give tune.budget_s={found['budget_needed_s']:.0f} or more"]
    if status == "not_glibc":
        return [f"malloc: not measured: {found['error']}"]
    if status == "failed":
        output = f"; its output: {found['output']}" if found.get("output") else ""
        return [f"malloc: not measured: its launch with malloc={found['malloc']} failed (exit "
                f"{found['exit_code']}; record {found['record']}{output})"]
    if status != "measured":
        return []
    default, raised = found["default_scores_mib_s"], found["raised_scores_mib_s"]
    ratio = (f"paired ratio raised/default {found['ratio_median']:.2f} "
             f"({found['ratio_min']:.2f}..{found['ratio_max']:.2f} over {len(raised)} rounds; "
             f"raised {min(raised):.1f}..{max(raised):.1f}, default "
             f"{min(default):.1f}..{max(default):.1f} MiB/s)")
    if found["raised_wins"]:
        return [f"malloc: raised wins beyond the noise (its worst score above the default's "
                f"best): {ratio}"]
    if found["raised_wins"] is None:
        return [f"malloc: keep the default: {len(raised)} round(s), too few to tell raised from "
                f"noise (raise tune.budget_s): {ratio}"]
    return [f"malloc: keep the default: raised did not beat it beyond the noise ({RULE}): "
            f"{ratio}"]


def print_result(summary: dict[str, Any], overrides: bool = True) -> None:
    defaults = summary["defaults"]
    rows = []
    for place, row in enumerate(summary["ranking"], start=1):
        changed = override_line(_changed(row["settings"], defaults)) or "defaults"
        rows.append([place, changed + (" *" if row["finalist"] else ""),
                     f"{row['ok']}/{row['runs']}", _spread(row["final_scores_mib_s"]),
                     _spread(row["scores_mib_s"]), _spread(row["save_mib_s"]),
                     _spread(row["load_mib_s"])])
    print(f"\ntune: {len(summary['trials'])} trials in {summary['wall_s']:.0f} s"
          + (f"; stopped early: {summary['stopped']}" if summary["stopped"] else "")
          + (f"; searched {', '.join(summary['searched'])}" if summary["searched"] else ""))
    print(tabulate(rows, headers=["#", "setting (vs defaults; * finalist)", "ok/runs",
                                  "finals MiB/s min/med/max", "all scores MiB/s min/med/max",
                                  "save MiB/s min/med/max", "load MiB/s min/med/max"],
                   tablefmt="github"))
    print()
    print(*verdict_lines(summary), sep="\n")
    print(f"records: {summary['session_dir']} (dcp-fsdp report {summary['session_dir']})",
          flush=True)
    if overrides:  # else the launcher's, after its malloc launches (launch/tune.py)
        print(f"OVERRIDES={override_line(summary['overrides'])}", flush=True)
