"""`dcp-fsdp tune`: the best connector settings for this model, world size and storage.

Each trial is a normal `save-and-load` run, launched as the CLI launches one
(`launch_local` on a config composed from the user's overrides plus the trial's), its
record written into `<results_dir>/tune-<stamp>/` (so `dcp-fsdp report` reads the whole
session); the ranks' own output goes to `trials.log` there. The search itself
(coordinate descent, finals, budget) is `tune_search.py`. The defaults run once with
ceiling=true, which gives the efficiency of the winner against the raw storage.

Tuned: storage.thread_count, part_size_mib, reader, prefix_strategy,
throughput_target_gbps (s3); storage.thread_count only (fs). A tuned setting given on
the command line is held at that value. Each trial's checkpoint is deleted after it
(they are the tuner's, not the user's); the embedded server, when used, is started
once for the whole session.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dcp_fsdp import log
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.tune_search import Budget, Search, SearchResult, Settings, Trial

MIB = 2**20

# Candidate values, the current default first-tried neighbours first. Most influential first.
S3_SPACE: dict[str, list[Any]] = {
    "storage.thread_count": [1, 2, 4, 8],
    "storage.part_size_mib": [8, 16, 32, 64],
    "storage.reader": ["dcp_optimized", "sequential", "range_based"],
    "storage.prefix_strategy": ["default", "binary", "hex"],
    "storage.throughput_target_gbps": [10.0, 25.0, 50.0, 5.0],
}
FS_SPACE: dict[str, list[Any]] = {"storage.thread_count": [1, 2, 4, 8]}


def _get(cfg: BenchmarkConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return getattr(value, "value", value)


def search_space(cfg: BenchmarkConfig, overrides: list[str]) -> tuple[dict[str, list[Any]], Settings]:
    """(values to try per setting, the starting settings). Settings the user gave are fixed."""
    space = S3_SPACE if cfg.storage.kind == StorageKind.s3 else FS_SPACE
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    start = {name: _get(cfg, name) for name in space}
    tuned = {}
    for name, values in space.items():
        if name in given:
            continue
        current = start[name]
        tuned[name] = [current] + [v for v in values if str(v) != str(current)]
    return tuned, start


def override_line(settings: Settings) -> str:
    return " ".join(f"{name}={value}" for name, value in settings.items())


@contextlib.contextmanager
def _stdout_to(path: Path):
    """The ranks inherit fd 1: their tables and progress lines go to the session log."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "a") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def figures_of(record_path: Path) -> dict[str, Any]:
    """Each op's pooled aggregate MiB/s (analysis/figures.py: the report's definition), the
    mean operation's seconds and bytes (their ratio is that figure) and the spread."""
    from dcp_fsdp.analysis.figures import summary
    from dcp_fsdp.telemetry.records import read_record_file

    parsed = read_record_file(record_path)
    run = parsed.runs[0] if parsed.runs else None
    figures: dict[str, Any] = {"run_id": run.run_id if run else None,
                               "status": run.status if run else "failed",
                               "suffixes": list(run.suffixes) if run else []}
    for op, found in summary(parsed.samples).items():
        if found["span_s"] > 0:
            figures[f"{op}_mib_s"] = found["aggregate_mib_s"]
            figures[f"{op}_s"] = found["mean_span_s"]
            figures[f"{op}_bytes"] = found["mean_bytes"]
            figures[f"{op}_spread"] = found["spread"]
    return figures


def score_of(figures: dict[str, Any]) -> float | None:
    """Save + load bytes over save + load time: what a save-and-load cycle achieves."""
    if figures.get("status") != "ok" or "save_s" not in figures or "load_s" not in figures:
        return None
    seconds = figures["save_s"] + figures["load_s"]
    return (figures["save_bytes"] + figures["load_bytes"]) / MIB / seconds if seconds > 0 else None


class Driver:
    def __init__(self, cfg: BenchmarkConfig, overrides: list[str], storage_overrides: list[str],
                 session_dir: Path, defaults: Settings) -> None:
        self.cfg = cfg
        self.defaults = defaults
        self.overrides = overrides
        self.storage_overrides = storage_overrides
        self.session_dir = session_dir
        self.count = 0

    def run_trial(self, settings: Settings, role: str) -> Trial:
        from dcp_fsdp.config.compose import compose
        from dcp_fsdp.launch.local import launch_local

        self.count += 1
        extra = [f"{name}={value}" for name, value in settings.items()]
        ceiling = role == "defaults"
        trial_overrides = [*self.overrides, *self.storage_overrides, *extra,
                           f"results_dir={self.session_dir}", f"ceiling={str(ceiling).lower()}"]
        before = set(self.session_dir.glob("*.jsonl"))
        started = time.monotonic()
        cfg = compose("save-and-load", trial_overrides)
        with _stdout_to(self.session_dir / "trials.log"):
            code = launch_local(cfg)
        wall_s = time.monotonic() - started
        new = sorted(set(self.session_dir.glob("*.jsonl")) - before)
        figures = figures_of(new[-1]) if new else {"status": "failed"}
        figures["exit_code"] = code
        self._delete_checkpoints(cfg, figures.get("suffixes", []))
        score = score_of(figures) if code == 0 else None
        changed = {k: v for k, v in settings.items() if str(v) != str(self.defaults.get(k))}
        shown = override_line(changed) or "(defaults)"
        if score is None:
            log.info(f"tune: trial {self.count} {role}: {shown}: FAILED (exit {code}; "
                     f"see {self.session_dir / 'trials.log'})")
        else:
            log.info(f"tune: trial {self.count} {role}: {shown}: save "
                     f"{figures['save_mib_s']:.1f} MiB/s, load {figures['load_mib_s']:.1f} "
                     f"MiB/s, score {score:.1f} MiB/s ({wall_s:.0f} s)")
        return Trial(settings, role, score, wall_s, figures)

    def _delete_checkpoints(self, cfg: BenchmarkConfig, suffixes: list[str]) -> None:
        """The trial's checkpoints are the tuner's: remove them (untimed, after the run)."""
        if not suffixes:
            return
        from dcp_fsdp.storage import make_store

        try:
            store = make_store(cfg.storage)
            for suffix in suffixes:
                store.delete(suffix)
        except Exception as error:  # a leftover checkpoint is no reason to stop tuning
            log.warning(f"tune: could not delete trial checkpoints {suffixes}: {error}")


def _warm_storage(cfg: BenchmarkConfig) -> None:
    """One small object written and removed before the first trial: a fresh S3-compatible
    server (SeaweedFS grows its volumes on the first write to a bucket) would otherwise
    charge that one-time set-up to the defaults, which always run first."""
    if cfg.storage.kind != StorageKind.s3:
        return
    from dcp_fsdp.storage import make_store

    make_store(cfg.storage).probe()


def tune(overrides: list[str], started_mono: float) -> int:
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.launch.preflight import preflight, storage_environment

    if "RANK" in os.environ:
        raise UserError("tune launches its own ranks (nproc=N); run it without torchrun")
    cfg = compose("save-and-load", overrides)
    if cfg.tune.budget_s <= 0:
        raise UserError(f"tune.budget_s={cfg.tune.budget_s:g}: must be positive (seconds)")
    if cfg.tune.trials is not None and cfg.tune.trials < 1:
        raise UserError(f"tune.trials={cfg.tune.trials}: must be 1 or more (or null)")
    if cfg.tune.repeats < 1:
        raise UserError(f"tune.repeats={cfg.tune.repeats}: must be 1 or more")
    space, start = search_space(cfg, overrides)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    session_dir = Path(cfg.results_dir) / f"tune-{stamp}-{os.getpid()}"
    session_dir.mkdir(parents=True, exist_ok=True)
    with storage_environment(cfg) as (cfg, server_env):
        os.environ.update(server_env)  # the trials' ranks inherit the embedded server's keys
        preflight(cfg, server_env)
        storage_overrides = []
        if server_env:  # the one embedded server, for every trial
            storage_overrides = [f"storage.uri={cfg.storage.uri}",
                                 f"storage.endpoint={cfg.storage.endpoint}",
                                 f"storage.region={cfg.storage.region}"]
        log.info(f"tune: model={cfg.model.preset} nproc={cfg.nproc} "
                 f"storage={cfg.storage.kind.value}; budget {cfg.tune.budget_s:g} s"
                 + (f", at most {cfg.tune.trials} trials" if cfg.tune.trials else "")
                 + f", {cfg.tune.repeats} repeats per finalist; tuning "
                 + (", ".join(space) or "nothing (every tuned setting was given)")
                 + f"; records in {session_dir}")
        _warm_storage(cfg)
        driver = Driver(cfg, overrides, storage_overrides, session_dir, start)
        budget = Budget(cfg.tune.budget_s, cfg.tune.trials, started_mono)
        search = Search(space, start, driver.run_trial, budget, cfg.tune.repeats, say=log.info)
        try:
            result = search.run()
        except RuntimeError as error:
            log.error(f"tune: {error} (exit codes and output: {session_dir / 'trials.log'})")
            return 1
    print_result(result, session_dir, time.monotonic() - started_mono)
    return 0


def print_result(result: SearchResult, session_dir: Path, wall_s: float) -> None:
    from tabulate import tabulate

    def spread(values: list[float]) -> str:
        return (f"{min(values):.1f}/{statistics.median(values):.1f}/{max(values):.1f}"
                if values else "")

    rows = []
    for place, ranked in enumerate(result.ranking, start=1):
        ok = [t for t in ranked.trials if t.score is not None]
        saves = [t.figures["save_mib_s"] for t in ok]
        loads = [t.figures["load_mib_s"] for t in ok]
        marks = " (defaults)" if ranked.settings == result.defaults else ""
        changed = {k: v for k, v in ranked.settings.items() if str(v) != str(result.defaults.get(k))}
        rows.append([place, (override_line(changed) or "defaults") + (marks if changed else ""),
                     f"{len(ok)}/{len(ranked.trials)}", spread(ranked.scores), spread(saves),
                     spread(loads)])
    print(f"\ntune: {len(result.trials)} trials in {wall_s:.0f} s"
          + (f"; stopped early: {result.stopped}" if result.stopped else "")
          + (f"; searched {', '.join(result.searched)}" if result.searched else ""))
    print(tabulate(rows, headers=["#", "setting (vs defaults)", "ok/runs",
                                  "score MiB/s min/med/max", "save MiB/s min/med/max",
                                  "load MiB/s min/med/max"], tablefmt="github"))
    best = result.best
    gain = result.gain
    print(f"\nbest: {override_line(best.settings)}")
    if gain is not None:
        print(f"gain over the defaults: {gain * 100:+.1f} % (median score {best.median:.1f} vs "
              f"{result.of(result.defaults).median:.1f} MiB/s)")
    ceiling = next((t.figures for t in result.trials if t.role == "defaults"), {})
    defaults = result.of(result.defaults)
    for label, ranked in (("best", best), ("defaults", defaults)):
        measured = [t.figures for t in (ranked.trials if ranked else []) if t.score is not None]
        parts = []
        for op, raw in (("save", "raw_put"), ("load", "raw_get")):
            if f"{raw}_mib_s" in ceiling and measured:
                dcp = statistics.median(f[f"{op}_mib_s"] for f in measured)
                parts.append(f"{op} {dcp:.1f} of {ceiling[f'{raw}_mib_s']:.1f} MiB/s "
                             f"(efficiency {dcp / ceiling[f'{raw}_mib_s']:.2f})")
        if parts:
            print(f"efficiency of the {label} against the ceiling (raw PUT/GET of the same "
                  f"objects with the defaults' client settings): " + "; ".join(parts))
        if ranked is defaults or best is defaults:
            break
    print(f"records: {session_dir} (dcp-fsdp report {session_dir})")
    print(f"OVERRIDES={override_line(best.settings)}", flush=True)
