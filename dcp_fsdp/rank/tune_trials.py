"""`dcp-fsdp tune` inside one launch: the ranks and the model are built once, only the storage
settings change between trials. Rank 0 runs the search (tune/search.py) and broadcasts each trial's
settings; every rank runs one save-and-load iteration of a normal run's loop (rank/loop.py) on a
store made from them. Each trial leaves a normal record in the session directory (its `tune` field:
its role) and no checkpoint; the result goes to `tune.json` there (docs/tune.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dcp_fsdp.units import MIB
from dcp_fsdp import contract, log
from dcp_fsdp.config.schema import BenchmarkConfig, to_config
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.process.failures import caused_by_interrupt, root_cause
from dcp_fsdp.tune.report import ceiling_summary as ceiling_summary_of
from dcp_fsdp.tune.report import efficiency_lines, print_result, result_summary
from dcp_fsdp.tune.search import CEILING_RESERVE_TRIALS, CEILING_ROUNDS, Budget, Search, Trial
from dcp_fsdp.telemetry import records

if TYPE_CHECKING:
    from dcp_fsdp.models.build import ShardedModel
    from dcp_fsdp.process.signals import InterruptGuard
    from dcp_fsdp.rank.loop import CheckpointLoop
    from dcp_fsdp.telemetry.records import Sample


def trial_config(cfg: BenchmarkConfig, settings: dict[str, Any], ceiling: bool,
                 iterations: int = 1) -> BenchmarkConfig:
    """The session's config with the trial's settings, as a command line would set them."""
    dotlist = [f"{name}={value}" for name, value in settings.items()]
    merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(dotlist))
    return dataclasses.replace(to_config(merged), ceiling=ceiling, iterations=iterations, suffix=None)


def figures_of(samples: Iterable[Sample]) -> dict[str, Any]:
    """Per operation its pooled aggregate MiB/s, seconds, bytes and spread (telemetry/figures.py,
    as the end-of-run table and `report` print them), and the score: save + load MiB per second."""
    from dcp_fsdp.telemetry.figures import summary

    found = summary(samples)
    figures: dict[str, Any] = {}
    for op in ("save", "load", "raw_put", "raw_get"):
        if op in found and found[op]["span_s"] > 0:
            for name, key in (("mib_s", "aggregate_mib_s"), ("s", "span_s"), ("bytes", "bytes"),
                              ("spread", "spread"), ("best_mib_s", "best_mib_s"),
                              ("median_mib_s", "median_mib_s")):
                figures[f"{op}_{name}"] = found[op][key]
            if op in ("save", "load"):
                figures[f"{op}_efficiency"] = found[op]["efficiency"]
    if {"save_s", "load_s"} <= figures.keys():
        figures["score_mib_s"] = ((figures["save_bytes"] + figures["load_bytes"]) / MIB
                                  / (figures["save_s"] + figures["load_s"]))
    return figures


class TuneTrials:
    # session: the RankSession (rank/session.py imports this module: no import back)
    def __init__(self, session: Any, sharded: ShardedModel, state_dict: dict[str, Any],
                 spec: dict[str, Any]) -> None:
        self.session = session
        self.sharded = sharded
        self.state_dict = state_dict
        self.spec = spec
        self.session_dir = Path(spec["session_dir"])
        self.count = 0
        self.init_rows: list = []
        self.async_saver = None
        # the session's run line, as the launcher named it: what an interrupt records
        self.base_run = session.run.model_copy()

    def run(self) -> None:
        from dcp_fsdp.rank.distributed import gather_to_keepers

        session = self.session
        session.init.init_s = time.monotonic() - session.process_start_mono
        # every trial's record (rank 0 writes them) carries them
        self.init_rows = gather_to_keepers(session.init, keepers=1) or [session.init]
        if session.is_coordinator:
            self._lead()
        else:
            self._follow()
        # Every trial is recorded already: the session writes no record of its own.
        session.loop = None
        session.run.run_id = ""

    def _follow(self) -> None:
        from dcp_fsdp.rank.distributed import broadcast_object

        while True:
            message = broadcast_object(None)
            if message[0] == "stop":
                if message[1]:
                    raise UserError(message[1])
                return
            self._trial(message[1], message[2])

    def _lead(self) -> None:
        from dcp_fsdp.rank.distributed import broadcast_object

        spec = self.spec
        # the share kept for the launcher's malloc launches after this one (launch/tune.py)
        budget = Budget(spec["budget_s"] - spec.get("malloc_reserve_s", 0.0), spec["trials"],
                        spec["started_mono"])
        budget.reserve_trials = CEILING_RESERVE_TRIALS
        if budget.why_not() is not None:  # start-up alone spent the budget
            problem = (f"tune.budget_s={spec['budget_s']:g} was spent before the first trial "
                       f"(start-up took {budget.elapsed_s():.0f} s); give more, e.g. "
                       f"tune.budget_s={max(60, int(budget.elapsed_s() * 4))}")
            broadcast_object(("stop", problem))
            raise UserError(problem)

        def run_trial(settings: dict[str, Any], role: str) -> Trial:
            broadcast_object(("trial", settings, role))
            return self._trial(settings, role)

        search = Search(spec["space"], spec["start"], run_trial, budget, spec["repeats"],
                        say=log.info, requires=spec.get("requires"))
        try:
            result = search.run()
        except RuntimeError as error:  # the defaults failed: nothing to compare with
            problem = f"tune: {error} (records in {self.session_dir})"
            broadcast_object(("stop", problem))
            raise BenchmarkFailure(problem) from None
        summary = result_summary(result, time.monotonic() - spec["started_mono"], self.session_dir,
                                 spec.get("requires"))
        # The verdict stands before the efficiency trial: an interrupt there loses only it.
        self._write_summary(summary)
        print_result(summary, overrides=False)  # the launcher's, with malloc (launch/tune.py)
        # The recommendation's efficiency: its own trial, with its own client settings (not
        # the defaults', measured once at the start), when the time kept for it is left.
        if budget.reserve_fits():
            summary["ceiling"] = {"trial": ceiling_summary_of(run_trial(result.best.settings,
                                                                        "ceiling"))}
        broadcast_object(("stop", None))
        self._write_summary(summary)
        for line in efficiency_lines(summary["ceiling"]):
            print(line, flush=True)

    def _write_summary(self, summary: dict[str, Any]) -> None:
        (self.session_dir / "tune.json").write_text(json.dumps(summary, indent=1) + "\n")

    def _trial(self, settings: dict[str, Any], role: str) -> Trial:
        from dcp_fsdp.rank.loop import CheckpointLoop
        from dcp_fsdp.storage import make_store

        session = self.session
        started = time.monotonic()
        self.count += 1
        ceiling = role == "ceiling"  # the recommendation's efficiency trial (_lead)
        cfg = trial_config(session.cfg, settings, ceiling, CEILING_ROUNDS if ceiling else 1)
        store = make_store(cfg.storage)
        os.environ.update(store.environment())
        run = self.base_run.model_copy(update={
            "config": records.config_for_record(cfg), "started_at": records.utc_now(),
            "tune": records.TuneTrial(trial=self.count, role=role, settings=settings)})
        session.run, session.store = run, store
        # one async saver for the session (its stager and daemon set up once, as in a run of
        # many saves): only storage settings change
        loop = session.loop = CheckpointLoop(cfg, session.ctx, store, self.sharded, self.state_dict,
                                             request_log=session.request_log, say=lambda message: None,
                                             on_timeout=session.on_timeout, async_saver=self.async_saver)
        status, error_line = _run_trial(loop, session.guard)
        self.async_saver = loop.async_saver
        store.close()  # what the trial's store made in this process (MSC's profile file)
        if not session.is_coordinator:
            session.loop, session.run = None, self.base_run.model_copy()
            return Trial(settings, role, None, time.monotonic() - started)
        for suffix in loop.suffixes:  # the trial's checkpoints are the tuner's: removed after it, untimed
            try:
                store.delete(suffix)
            except Exception as error:  # a leftover checkpoint is no reason to stop tuning
                log.warning(f"tune: could not delete trial checkpoint {suffix}: {error}")
        figures = figures_of(loop.shared_samples) if status == "ok" else {}
        run.run_id = records.new_run_id("save-and-load")
        path = session.write_record(status, error_line, loop.shared_samples, self.init_rows)
        # Between trials an interrupt records the session's own line, with no samples.
        session.loop, session.run = None, self.base_run.model_copy()
        figures.update(status=status, record=str(path), error=error_line)
        score = figures.get("score_mib_s")
        wall_s = time.monotonic() - started
        shown = " ".join(f"{k}={v}" for k, v in settings.items()
                         if str(v) != str(self.spec["start"].get(k))) or "(defaults)"
        if score is None:
            log.info(f"tune: trial {self.count} {role}: {shown}: FAILED ({error_line})")
        else:
            log.info(f"tune: trial {self.count} {role}: {shown}: save "
                     f"{figures['save_mib_s']:.1f} MiB/s, load {figures['load_mib_s']:.1f} MiB/s, "
                     f"score {score:.1f} MiB/s ({wall_s:.1f} s)")
        return Trial(settings, role, score, wall_s, figures)


def load_spec() -> dict[str, Any] | None:
    """The tune session's plan, when the launcher started these ranks for `tune`."""
    path = os.environ.get(contract.TUNE_ENV)
    return json.loads(Path(path).read_text()) if path else None


def _run_trial(loop: CheckpointLoop, guard: InterruptGuard) -> tuple[str, str | None]:
    """(status, error line) of one trial's loop: a failure every rank raises alike ends the
    trial, not the session; anything else ends the session, and so does any failure once
    this rank has been signalled (the first rank to stop breaks the others' collective)."""
    try:
        loop.run()
    except (UserError, BenchmarkFailure) as error:  # raised on every rank alike
        if guard.signal_name is not None:
            raise
        return "failed", str(error)
    except BaseException as error:  # DCP's CheckpointException: collective, every rank
        if (guard.signal_name is not None or type(error).__name__ != "CheckpointException"
                or caused_by_interrupt(error)):
            raise
        return "failed", root_cause(error)
    return "ok", None
