"""The search behind `dcp-fsdp tune`, apart from how a trial runs (unit-tested with a fake).

A trial measures one setting (a dict of the tuned connector settings) and returns a
score (higher is better: the run's save + load MiB/s) and its wall time. The search:

  1. the defaults, once (the driver runs this one with ceiling=true);
  2. coordinate descent from the best so far: each setting in turn (the most influential
     first), every value of it with the others held; a value replaces the current one
     only when it beats it by more than `margin` (one noisy measurement must not move
     the search);
  3. the finalists (the descent's winner and the next best, the defaults always among
     them) measured again, in turns (fewest measurements first), until each has `repeats`
     measurements; ranked by their median.

Budget: a trial starts only if the time spent plus the estimated cost of this trial (the
larger of the median and the latest trial wall time) fits in `budget_s`; the search phase
stops at 60 % of the budget (and of `max_trials`, which counts every run, defaults and
repeats included), leaving the rest for the finals' repeats. The only overrun is one trial running longer than its estimate.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

Settings = dict[str, Any]
SEARCH_SHARE = 0.6  # of the budget and of tune.trials, for the search; the rest: the finals


def settings_key(settings: Settings) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in settings.items()))


@dataclasses.dataclass
class Trial:
    settings: Settings
    role: str  # "defaults" | "search" | "repeat"
    score: float | None  # None: the trial failed
    wall_s: float
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ranked:
    settings: Settings
    scores: list[float]
    trials: list[Trial]

    @property
    def median(self) -> float:
        return statistics.median(self.scores)


@dataclasses.dataclass
class SearchResult:
    trials: list[Trial]
    ranking: list[Ranked]  # best first (finalists, then the other settings tried)
    defaults: Settings
    searched: list[str]  # settings whose every value was tried
    stopped: str | None  # why the search ended early (budget, trials), or None

    @property
    def best(self) -> Ranked:
        return self.ranking[0]

    def of(self, settings: Settings) -> Ranked | None:
        key = settings_key(settings)
        return next((r for r in self.ranking if settings_key(r.settings) == key), None)

    @property
    def gain(self) -> float | None:
        """Best median / defaults median - 1."""
        defaults = self.of(self.defaults)
        if defaults is None or not defaults.scores or defaults.median <= 0:
            return None
        return self.best.median / defaults.median - 1


class Budget:
    def __init__(self, budget_s: float, max_trials: int | None, started_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self.max_trials = max_trials
        self.started_s = started_s
        self.clock = clock
        self.walls: list[float] = []

    def elapsed_s(self) -> float:
        return self.clock() - self.started_s

    def estimate_s(self) -> float:
        if not self.walls:
            return 0.0
        return max(statistics.median(self.walls), self.walls[-1])

    def why_not(self, share: float = 1.0) -> str | None:
        """None if one more trial fits in `share` of the budget (and of the trial count)."""
        if self.max_trials is not None and len(self.walls) + 1 > max(1, int(self.max_trials * share)):
            return f"tune.trials={self.max_trials} reached"
        if self.elapsed_s() + self.estimate_s() > self.budget_s * share:
            return f"tune.budget_s={self.budget_s:g} would be exceeded"
        return None


class Search:
    def __init__(self, space: dict[str, list[Any]], defaults: Settings,
                 run_trial: Callable[[Settings, str], Trial], budget: Budget, repeats: int,
                 finalists: int = 3, margin: float = 0.03,
                 say: Callable[[str], None] = lambda message: None) -> None:
        self.space = space
        self.defaults = dict(defaults)
        self.run_trial = run_trial
        self.budget = budget
        self.repeats = max(1, repeats)
        self.finalists = max(1, finalists)
        self.margin = margin
        self.say = say
        self.trials: list[Trial] = []

    # -- bookkeeping -----------------------------------------------------------------------
    def _run(self, settings: Settings, role: str) -> Trial:
        trial = self.run_trial(dict(settings), role)
        self.trials.append(trial)
        self.budget.walls.append(trial.wall_s)
        return trial

    def _scores(self, settings: Settings) -> list[float]:
        key = settings_key(settings)
        return [t.score for t in self.trials
                if settings_key(t.settings) == key and t.score is not None]

    def _attempts(self, settings: Settings) -> int:
        key = settings_key(settings)
        return sum(settings_key(t.settings) == key for t in self.trials)

    def _best_score(self, settings: Settings) -> float | None:
        scores = self._scores(settings)
        return statistics.median(scores) if scores else None

    @property
    def search_share(self) -> float:
        """The part of the budget (and trial count) the search may use: the rest is left
        for the finals' repeats, when there are any."""
        return 1.0 if self.repeats == 1 else SEARCH_SHARE

    # -- the phases ------------------------------------------------------------------------
    def run(self) -> SearchResult:
        stopped = self.budget.why_not()
        if stopped is None:
            first = self._run(self.defaults, "defaults")
            if first.score is None:
                raise RuntimeError("the defaults failed; fix the run before tuning it")
        searched, stopped = self._descend(stopped)
        stopped = self._finals(stopped)
        return SearchResult(self.trials, self._ranking(), self.defaults, searched, stopped)

    def _descend(self, stopped: str | None) -> tuple[list[str], str | None]:
        best = dict(self.defaults)
        searched: list[str] = []
        tried = {settings_key(t.settings) for t in self.trials}
        for name, values in self.space.items():
            if stopped:
                break
            for value in values:
                candidate = {**best, name: value}
                if settings_key(candidate) in tried:
                    continue
                stopped = self.budget.why_not(self.search_share)
                if stopped:
                    break
                tried.add(settings_key(candidate))
                trial = self._run(candidate, "search")
                best_score = self._best_score(best)
                if trial.score is not None and (best_score is None or
                                                trial.score > best_score * (1 + self.margin)):
                    best = candidate
            else:
                searched.append(name)
                self.say(f"tune: {name} searched; best so far "
                         f"{' '.join(f'{k}={v}' for k, v in best.items())}")
        self._descent_best = best
        return searched, stopped

    def _finalist_settings(self) -> list[Settings]:
        seen: dict[tuple, Settings] = {}
        for trial in self.trials:
            if trial.score is not None:
                seen.setdefault(settings_key(trial.settings), trial.settings)
        ordered = sorted(seen.values(), key=lambda s: self._best_score(s), reverse=True)
        chosen = [self.defaults]
        for settings in [getattr(self, "_descent_best", self.defaults), *ordered]:
            if len(chosen) >= self.finalists:
                break
            if settings_key(settings) not in {settings_key(c) for c in chosen}:
                chosen.append(settings)
        return chosen

    def _finals(self, stopped: str | None) -> str | None:
        if stopped and not self.trials:
            return stopped
        finalists = self._final_list = self._finalist_settings()
        while True:
            # the defaults and the winner first (the gain is measured between them), then
            # any third; within each, the one with the fewest measurements
            # (attempts, not successes: a setting that fails is not retried for ever)
            short = [(index >= 2, self._attempts(s), index) for index, s in enumerate(finalists)
                     if self._attempts(s) < self.repeats]
            if not short:
                return stopped
            why = self.budget.why_not()
            if why:
                return stopped or why
            self._run(finalists[min(short)[2]], "repeat")

    def _ranking(self) -> list[Ranked]:
        groups: dict[tuple, Ranked] = {}
        for trial in self.trials:
            group = groups.setdefault(settings_key(trial.settings),
                                      Ranked(trial.settings, [], []))
            group.trials.append(trial)
            if trial.score is not None:
                group.scores.append(trial.score)
        scored = [g for g in groups.values() if g.scores]
        # The finalists (measured again) rank first, by median; a setting measured once
        # in the search, however lucky, only after them.
        final_keys = {settings_key(s) for s in getattr(self, "_final_list", [])}
        finals = sorted((g for g in scored if settings_key(g.settings) in final_keys),
                        key=lambda g: g.median, reverse=True)
        others = sorted((g for g in scored if settings_key(g.settings) not in final_keys),
                        key=lambda g: g.median, reverse=True)
        failed = [g for g in groups.values() if not g.scores]
        return finals + others + failed
