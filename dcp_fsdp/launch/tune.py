"""`dcp-fsdp tune`: the best storage settings for this model, world size and storage (docs/tune.md).

The parent (light: no torch) writes the session's plan and launches the ranks ONCE; rank 0 runs
every trial, the search and the verdict (rank/tune_trials.py). Then, unless malloc= was given,
the recommendation runs in paired launches, malloc=default then raised (glibc reads them as a
process starts). Ctrl-C or SIGTERM stops the whole tune (exit 130).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dcp_fsdp import contract, log, storage
from dcp_fsdp.config.compose import check_overrides, compose
from dcp_fsdp.config.schema import MLPERF_CHECKPOINTS, BenchmarkConfig, Malloc, Protocol, StorageKind
from dcp_fsdp.config.validate import CLIENT_ONLY
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import local
from dcp_fsdp.launch.agent import raise_terminated
from dcp_fsdp.launch.checks import check_environment, check_launch
from dcp_fsdp.launch.preflight import preflight, storage_environment
from dcp_fsdp.rank.tune_trials import figures_of, trial_config
from dcp_fsdp.telemetry.records import read_record_file
from dcp_fsdp.tune.report import malloc_lines, override_line
from dcp_fsdp.tune.search import MIN_FINAL_SCORES, Budget, Settings, paired_malloc

# Below this no trial fits: the ranks' start-up alone (process group, model build) takes
# several seconds on the smallest model. A larger budget that start-up still spends is
# refused by rank 0 before the first trial (rank/tune_trials.py).
MIN_BUDGET_S = 10.0
# Of tune.budget_s, kept from the search for the paired malloc launches after it: each is a
# whole launch (start-up included), and the rule needs MIN_FINAL_SCORES rounds of two.
MALLOC_SHARE = 0.25

# Candidate values, the current default first-tried neighbours first. Most influential first.
S3_SPACE: dict[str, list[Any]] = {
    "storage.thread_count": [1, 2, 4, 8],
    # the DCP client itself (docs/clients.md): its own settings are the defaults
    "storage.client": ["s3torchconnector", "fsspec", "msc"],
    "storage.part_size_mib": [8, 16, 32, 64],
    "storage.reader": ["dcp_optimized", "sequential", "range_based"],
    "storage.max_gap_size_mib": [32.0, 0.0, 8.0, 128.0],
    "storage.prefix_strategy": ["default", "binary", "hex"],
    "storage.throughput_target_gbps": [10.0, 25.0, 50.0, 5.0],
    # the tool's own reader (storage/read_ahead.py), not DCP's: labelled as such if chosen
    "storage.read_ahead": [0, 4, 8],
}
FS_SPACE: dict[str, list[Any]] = {"storage.thread_count": [1, 2, 4, 8], "storage.read_ahead": [0, 4, 8]}
# DCP's own knob, for any storage: sync saves only (validate.py refuses it with async).
DCP_SPACE: dict[str, list[Any]] = {"plan_caching": [False, True]}
# A setting that matters only when another has a given value: not searched otherwise, and
# left out of the OVERRIDES= line (a run refuses it there).
CONNECTOR: tuple[str, Any] = ("storage.client", "s3torchconnector")
CLIENT_SETTINGS = frozenset().union(*CLIENT_ONLY.values())  # the settings of one client each
DCPS_READER: tuple[str, Any] = ("storage.read_ahead", 0)  # the tool's reader has no reader kind
REQUIRES: dict[str, Any] = {
    **{name: CONNECTOR for name in ("storage.part_size_mib", "storage.prefix_strategy",
                                    "storage.throughput_target_gbps")},
    "storage.reader": [CONNECTOR, DCPS_READER],
    "storage.max_gap_size_mib": [("storage.reader", "dcp_optimized"), CONNECTOR, DCPS_READER]}


def search_space(cfg: BenchmarkConfig, given: set[str]) -> tuple[dict[str, list[Any]], Settings]:
    """(values to try per setting, the starting settings). The settings the user gave
    (`given`: their names, config.compose.check_overrides) are fixed."""
    space = dict(S3_SPACE if cfg.storage.kind == StorageKind.s3 else FS_SPACE)
    if cfg.save_mode.value == "sync":
        space.update(DCP_SPACE)
    given = set(given)
    if given & CLIENT_SETTINGS or (cfg.save_mode.value == "async"
                                   and cfg.async_save.checkpointer.value == "process"):
        # a client's own setting given names the client; the process checkpointer's daemon
        # is started once, with the first trial's client environment (MSC's profile)
        given.add("storage.client")
    values = {name: functools.reduce(getattr, name.split("."), cfg) for name in space}
    start = {name: getattr(value, "value", value) for name, value in values.items()}  # an enum's value
    tuned = {name: [start[name]] + [v for v in values if str(v) != str(start[name])]
             for name, values in space.items() if name not in given}
    return tuned, start


def tune(overrides: list[str], started_mono: float) -> int:
    if "RANK" in os.environ:
        raise UserError("tune launches its own ranks (nproc=N); run it without torchrun")
    cfg = compose("save-and-load", overrides)
    given = check_overrides(overrides)  # the setting names given, as compose read them
    # what tune cannot honour, before anything starts (validate.py checked tune.*'s ranges)
    if cfg.protocol == Protocol.mlperf:  # `report` would show its trials as MLPerf's figures
        raise UserError("protocol=mlperf: tune's trials run 1 and 3 save-and-load iterations, "
                        f"not MLPerf's {MLPERF_CHECKPOINTS} saves then {MLPERF_CHECKPOINTS} "
                        "loads; tune without it, then run save-and-load protocol=mlperf with "
                        "the OVERRIDES it prints")
    if cfg.tune.budget_s < MIN_BUDGET_S:
        raise UserError(f"tune.budget_s={cfg.tune.budget_s:g}: too small for one trial (the "
                        f"ranks' start-up alone takes seconds); give at least "
                        f"{MIN_BUDGET_S:g}, e.g. tune.budget_s=120 for a search")
    check_launch(cfg)  # as any launch, before the storage: the environment's endpoint too
    space, start = search_space(cfg, given)
    malloc = _malloc_held(cfg, given)  # None: measured after the search
    session_dir = Path(cfg.results_dir) / f"tune-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    # SIGTERM (scancel, kill) ends the tune like Ctrl-C, also while the server starts.
    previous_sigterm = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with storage_environment(cfg) as (cfg, server_env, _):
            os.environ.update(server_env)  # the ranks inherit the embedded server's keys
            preflight(cfg, server_env)
            session_dir.mkdir(parents=True, exist_ok=True)
            log.info(f"tune: model={cfg.model.name} nproc={cfg.nproc} "
                     f"storage={cfg.storage.kind.value}; budget {cfg.tune.budget_s:g} s"
                     + (f", at most {cfg.tune.trials} trials" if cfg.tune.trials else "")
                     + f", {cfg.tune.repeats} final rounds; tuning "
                     + (", ".join(space) or "nothing (every tuned setting was given)")
                     + ("" if malloc else ", then malloc (paired launches)")
                     + f"; records in {session_dir}")
            # One small object written and removed before the first trial: a fresh server's
            # set-up on the first write would be charged to the defaults, which always run first.
            if cfg.storage.kind == StorageKind.s3:
                storage.make_store(cfg.storage).probe()  # the store's own untimed first write
            plan = {"session_dir": str(session_dir), "space": space, "start": start,
                    "budget_s": cfg.tune.budget_s, "trials": cfg.tune.trials,
                    "repeats": cfg.tune.repeats, "started_mono": started_mono,
                    "requires": {k: v for k, v in REQUIRES.items() if k in start},
                    "malloc_reserve_s": 0.0 if malloc else cfg.tune.budget_s * MALLOC_SHARE}
            plan_path = session_dir / "tune-plan.json"
            plan_path.write_text(json.dumps(plan, indent=1) + "\n")
            cfg.results_dir, cfg.ceiling = str(session_dir), False
            os.environ[contract.TUNE_ENV] = str(plan_path)
            launched = time.monotonic()
            try:
                code = local.launch_local(cfg)
            finally:
                os.environ.pop(contract.TUNE_ENV, None)
            if code == contract.EXIT_OK:
                code = _after_search(cfg, session_dir, malloc, started_mono,
                                     time.monotonic() - launched)
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    if code == contract.EXIT_INTERRUPTED:
        _say_interrupted(session_dir, time.monotonic() - started_mono)
    return code


def _malloc_held(cfg: BenchmarkConfig, given: set[str]) -> dict[str, Any] | None:
    """tune.json's malloc block where no launch measures it: given (held), or refused with
    the ranks' allocator (launch/checks.py); None: measured after the search."""
    if "malloc" in given:
        return {"status": "held", "chosen": cfg.malloc.value}
    try:  # what a launch with malloc=raised would refuse (another allocator, MALLOC_* set)
        check_environment(dataclasses.replace(cfg, malloc=Malloc.raised))
    except UserError as error:
        return {"status": "not_glibc", "error": str(error), "chosen": Malloc.default.value}
    return None


def _after_search(cfg: BenchmarkConfig, session_dir: Path, malloc: dict[str, Any] | None,
                  started_mono: float, search_wall_s: float) -> int:
    """The malloc launches (unless held), then the malloc and OVERRIDES= lines, as tune.json."""
    path = session_dir / "tune.json"
    summary = json.loads(path.read_text())
    try:
        found = malloc or _malloc_launches(cfg, summary, started_mono, search_wall_s)
    except KeyboardInterrupt:
        return contract.EXIT_INTERRUPTED
    summary["malloc"] = found
    summary["overrides"]["malloc"] = found["chosen"]
    path.write_text(json.dumps(summary, indent=1) + "\n")
    for line in malloc_lines(found):
        print(line)
    print(f"OVERRIDES={override_line(summary['overrides'])}", flush=True)
    return contract.EXIT_OK


def _malloc_launches(cfg: BenchmarkConfig, summary: dict[str, Any], started_mono: float,
                     search_wall_s: float) -> dict[str, Any]:
    """The recommendation launched with malloc=default then malloc=raised, per round, while
    a round fits the budget; a launch costs what the search's start-up cost plus a trial."""
    walls = [t["wall_s"] for t in summary["trials"]]
    launch_s = (max(0.0, search_wall_s - sum(walls) - summary["ceiling"].get("trial", {}).get(
        "wall_s", 0.0)) + statistics.median(walls))
    budget = Budget(cfg.tune.budget_s, None, started_mono)
    budget.walls.append(launch_s)
    needed_s = MIN_FINAL_SCORES * 2 * launch_s
    if budget.elapsed_s() + needed_s > cfg.tune.budget_s:
        return {"status": "no_room", "chosen": Malloc.default.value, "launch_s": launch_s,
                "needed_s": needed_s, "left_s": cfg.tune.budget_s - budget.elapsed_s(),
                "budget_needed_s": math.ceil(needed_s / MALLOC_SHARE)}
    rounds: list[tuple[float, float]] = []
    records: list[str | None] = []
    while (len(rounds) < cfg.tune.repeats
           and budget.elapsed_s() + 2 * budget.estimate_s() <= cfg.tune.budget_s):
        scores: list[float] = []
        for value in (Malloc.default.value, Malloc.raised.value):
            launched = time.monotonic()
            output = Path(cfg.results_dir) / f"malloc-round{len(rounds) + 1}-{value}.log"
            launch = _malloc_launch(cfg, summary["overrides"], value, output)
            budget.walls.append(time.monotonic() - launched)
            records.append(launch.record)
            log.info(_launch_line(len(rounds) + 1, value, launch, budget.walls[-1],
                                  scores[0] if scores else None))
            if launch.code == contract.EXIT_INTERRUPTED:
                raise KeyboardInterrupt()
            if launch.score is None:
                return {"status": "failed", "chosen": Malloc.default.value, "malloc": value,
                        "exit_code": launch.code, "record": launch.record, "records": records,
                        "output": launch.output}
            scores.append(launch.score)
        rounds.append((scores[0], scores[1]))
    return {"status": "measured", **paired_malloc(rounds), "records": records}


@dataclasses.dataclass
class MallocLaunch:
    """One paired launch as tune saw it: exit code, record, figures, its checkpoint's fate."""

    code: int
    record: str | None = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None  # the record's error line
    checkpoint: str = "it left no checkpoint"  # or what became of it
    output: str | None = None  # the launch's own output, kept where it did not succeed

    @property
    def score(self) -> float | None:
        return self.figures.get("score_mib_s") if self.code == contract.EXIT_OK else None


def _malloc_launch(cfg: BenchmarkConfig, settings: Settings, malloc: str,
                   output: Path) -> MallocLaunch:
    """One save-and-load of `settings` with `malloc` through the launcher's entry. Its whole output
    goes to `output`, kept only if it failed (tune says in one line what it measured); its
    checkpoint is deleted here: the tune's embedded server (if any) lives on until the tune ends."""
    run_cfg = trial_config(cfg, {**settings, "malloc": malloc}, ceiling=False)
    before = set(Path(cfg.results_dir).glob("*.jsonl"))
    with _output_to(output):
        code = local.launch_local(run_cfg)
    made = sorted(set(Path(cfg.results_dir).glob("*.jsonl")) - before)
    launch = MallocLaunch(code, checkpoint="it wrote no record (its checkpoint, if any, unknown)")
    if made:
        found = read_record_file(made[0])
        run = found.runs[0] if found.runs else None
        launch.record, launch.figures = str(made[0]), figures_of(found.samples)
        launch.error = run.error if run is not None else None
        launch.checkpoint = _delete_checkpoints(run_cfg, [] if run is None else [
            s for s in dict.fromkeys([*run.suffixes, run.incomplete_suffix]) if s])
    if launch.score is None and code != contract.EXIT_INTERRUPTED:
        launch.output = str(output)
    else:  # measured, or stopped by the user: the one line says it
        output.unlink(missing_ok=True)
    return launch


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's fds 1 and 2 into `path` until the block ends (the ranks inherit them)."""
    _flush_std()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "ab") as output:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
        yield
    finally:
        _flush_std()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _delete_checkpoints(run_cfg: BenchmarkConfig, suffixes: list[str]) -> str:
    """A paired launch's checkpoints deleted; what became of them, in words."""
    if not suffixes:
        return "it left no checkpoint"
    for number, suffix in enumerate(suffixes):
        try:
            storage.make_store(run_cfg.storage).delete(suffix)
        except Exception as error:  # a leftover checkpoint is no reason to stop tuning
            deleted = f"its checkpoint {','.join(suffixes[:number])} deleted by tune; " if number else ""
            fate = ("it goes with the tune's embedded S3 server at its exit"
                    if os.environ.get(contract.EMBEDDED_ENV) == "1" else
                    f"`dcp-fsdp delete suffix={suffix}` with the same storage settings removes it")
            return f"{deleted}its checkpoint {suffix} could not be deleted ({error}): {fate}"
    return f"its checkpoint {','.join(suffixes)} deleted by tune"


def _launch_line(round_number: int, malloc: str, launch: MallocLaunch, wall_s: float,
                 default_score: float | None) -> str:
    """The one line of a paired launch: what it measured, and what became of its checkpoint."""
    head = f"tune: malloc round {round_number}, malloc={malloc}"
    if launch.code == contract.EXIT_INTERRUPTED:
        return f"{head}: interrupted ({wall_s:.1f} s); {launch.checkpoint}"
    if launch.score is None:
        said = f": {launch.error}" if launch.error else ""
        return (f"{head}: failed (exit {launch.code}{said}; {wall_s:.1f} s); {launch.checkpoint}; "
                f"its output: {launch.output}")
    figures = launch.figures
    ratio = f", {launch.score / default_score:.2f}x the default's" if default_score else ""
    return (f"{head}: save {figures['save_mib_s']:.1f} MiB/s, load {figures['load_mib_s']:.1f} "
            f"MiB/s, score {launch.score:.1f} MiB/s{ratio} ({wall_s:.1f} s launch); "
            f"{launch.checkpoint}")


def _say_interrupted(session_dir: Path, after_s: float) -> None:
    done = len(list(session_dir.glob("*.jsonl")))
    if (session_dir / "tune.json").exists():  # the verdict was printed: only the
        # recommendation's efficiency trial or the malloc launches were cut
        log.info(f"tune: interrupted after {after_s:.0f} s, after the verdict (in the "
                 "efficiency trial or the malloc launches): the recommendation above stands "
                 f"(tune.json), malloc not measured; the records ({done}) stay in {session_dir}")
        summary = json.loads((session_dir / "tune.json").read_text())
        print(f"OVERRIDES={override_line(summary['overrides'])}", flush=True)
    else:
        log.info(f"tune: interrupted after {after_s:.0f} s: no recommendation from a cut "
                 f"search; the records ({done}) stay in {session_dir}")
