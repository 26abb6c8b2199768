"""The search behind `dcp-fsdp tune`, apart from how a trial runs (unit-tested with a fake): the
defaults, a coordinate descent, then the finals, whose rounds alone decide (docs/tune.md, "The
search", also for how the budget is shared)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

Settings = dict[str, Any]
SEARCH_SHARE = 0.6  # of the budget and of tune.trials, for the search; the rest: the finals
# The recommendation's efficiency trial after the finals (rank/tune_trials.py): this many
# save-and-load iterations with ceiling=true. Its time is kept from the finals: about two
# trials' worth per iteration (DCP's save and load, then the raw rounds).
CEILING_ROUNDS = 3
CEILING_RESERVE_TRIALS = 2.0 * CEILING_ROUNDS
MIN_FINAL_SCORES = 2  # final measurements of the defaults and of a winner, at the least


def applies(name: str, settings: Settings, requires: dict[str, Any]) -> bool:
    """Whether `name` has any effect under `settings` (`requires`: name -> (other, value),
    or a list of such pairs, every one of which must hold)."""
    if name not in requires:
        return True
    conditions = requires[name]
    if conditions and isinstance(conditions[0], str):
        conditions = [conditions]
    return all(str(settings.get(other, value)) == str(value) for other, value in conditions)


def settings_key(settings: Settings) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in settings.items()))


@dataclasses.dataclass
class Trial:
    settings: Settings
    role: str  # "defaults" | "search" | "repeat" | "ceiling" (the efficiency trial)
    score: float | None  # save + load aggregate MiB/s (higher is better); None: the trial failed
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
    ranking: list[Ranked]  # finalists first (by their finals' median), then the others
    defaults: Settings
    searched: list[str]  # settings whose every value was tried
    stopped: str | None  # why the search ended early (budget, trials), or None
    finalists: list[Settings] = dataclasses.field(default_factory=list)

    def of(self, settings: Settings) -> Ranked | None:
        key = settings_key(settings)
        return next((r for r in self.ranking if settings_key(r.settings) == key), None)

    def final_scores(self, settings: Settings) -> list[float]:
        """The finals' (interleaved) measurements of `settings`: what the verdict uses."""
        key = settings_key(settings)
        return [t.score for t in self.trials if t.role == "repeat" and t.score is not None
                and settings_key(t.settings) == key]

    @property
    def recommended(self) -> Settings | None:
        """The candidate whose worst final score beats the defaults' best (two or more of
        each), the highest median first; None: keep the defaults."""
        base = self.final_scores(self.defaults)
        if len(base) < MIN_FINAL_SCORES:
            return None
        winners = []
        for settings in self.finalists:
            scores = self.final_scores(settings)
            if (settings_key(settings) != settings_key(self.defaults)
                    and len(scores) >= MIN_FINAL_SCORES and min(scores) > max(base)):
                winners.append((statistics.median(scores), settings))
        return max(winners, key=lambda w: w[0])[1] if winners else None

    @property
    def best(self) -> Ranked:
        """What tune recommends: the winner, else the defaults (none beat them beyond the spread)."""
        chosen = self.recommended
        found = self.of(chosen if chosen is not None else self.defaults)
        return found if found is not None else Ranked(self.defaults, [], [])

    @property
    def noise(self) -> float | None:
        """Spread of the defaults' final scores, (max - min) / median; None below two."""
        base = self.final_scores(self.defaults)
        if len(base) < MIN_FINAL_SCORES or statistics.median(base) <= 0:
            return None
        return (max(base) - min(base)) / statistics.median(base)

    @property
    def gain(self) -> float | None:
        """The recommendation's final median / the defaults' final median - 1 (0.0 when the
        answer is the defaults)."""
        chosen = self.recommended
        if chosen is None:
            return 0.0 if self.final_scores(self.defaults) else None
        return (statistics.median(self.final_scores(chosen))
                / statistics.median(self.final_scores(self.defaults)) - 1)


@dataclasses.dataclass
class Budget:
    budget_s: float
    max_trials: int | None
    started_s: float
    clock: Callable[[], float] = time.monotonic
    walls: list[float] = dataclasses.field(default_factory=list)
    # trials' worth of time kept for after the finals (tune's efficiency trial): the
    # finals stop that much earlier
    reserve_trials: float = 0.0
    # time already spent when the trials began (start-up): a share of the budget is a
    # share of what is left for trials, so a slow start-up cannot eat the search
    before_trials_s: float = 0.0

    def elapsed_s(self) -> float:
        return self.clock() - self.started_s

    def estimate_s(self) -> float:
        return max(statistics.median(self.walls), self.walls[-1]) if self.walls else 0.0

    def why_not(self, share: float = 1.0) -> str | None:
        """None if one more trial fits in `share` of the budget (and of the trial count)."""
        if self.max_trials is not None and len(self.walls) + 1 > max(1, int(self.max_trials * share)):
            return f"tune.trials={self.max_trials} reached"
        limit_s = self.before_trials_s + (self.budget_s - self.before_trials_s) * share
        # the reserve comes off the finals (the whole budget), never the search's share
        reserve_s = self.estimate_s() * self.reserve_trials if share >= 1.0 else 0.0
        if self.elapsed_s() + self.estimate_s() + reserve_s > limit_s:
            return f"tune.budget_s={self.budget_s:g} would be exceeded"
        return None

    def reserve_fits(self) -> bool:
        """Whether the reserved trials' worth of time still fits in the budget."""
        return self.elapsed_s() + self.estimate_s() * self.reserve_trials <= self.budget_s


class Search:
    def __init__(self, space: dict[str, list[Any]], defaults: Settings,
                 run_trial: Callable[[Settings, str], Trial], budget: Budget, repeats: int,
                 finalists: int = 3, margin: float = 0.03,
                 say: Callable[[str], None] = lambda message: None,
                 requires: dict[str, Any] | None = None) -> None:
        self.space = space
        self.defaults = dict(defaults)
        self.run_trial = run_trial
        self.budget = budget
        self.repeats = max(1, repeats)
        self.finalists = max(1, finalists)
        self.margin = margin
        self.say = say
        # setting -> (other setting, value) or a list of them: searched only while they hold
        self.requires = dict(requires or {})
        self.trials: list[Trial] = []
        self._descent_best = self.defaults
        self._final_list: list[Settings] = []

    def _run(self, settings: Settings, role: str) -> Trial:
        trial = self.run_trial(dict(settings), role)
        self.trials.append(trial)
        self.budget.walls.append(trial.wall_s)
        return trial

    def _best_score(self, settings: Settings) -> float | None:
        key = settings_key(settings)
        scores = [t.score for t in self.trials if settings_key(t.settings) == key and t.score is not None]
        return statistics.median(scores) if scores else None

    def run(self) -> SearchResult:
        self.budget.before_trials_s = max(0.0, self.budget.elapsed_s())
        stopped = self.budget.why_not()
        if stopped is None:
            first = self._run(self.defaults, "defaults")
            if first.score is None:
                raise RuntimeError("the defaults failed; fix the run before tuning it")
        searched, stopped = self._descend(stopped)
        stopped = self._finals(stopped)
        return SearchResult(self.trials, self._ranking(), self.defaults, searched, stopped,
                            list(self._final_list))

    def _descend(self, stopped: str | None) -> tuple[list[str], str | None]:
        best = dict(self.defaults)
        share = 1.0 if self.repeats == 1 else SEARCH_SHARE  # the rest: the finals' repeats
        searched: list[str] = []
        tried = {settings_key(t.settings) for t in self.trials}
        for name, values in self.space.items():
            if stopped:
                break
            if not applies(name, best, self.requires):
                continue  # e.g. the reader's gap size, with a reader that has none
            for value in values:
                candidate = {**best, name: value}
                if settings_key(candidate) in tried:
                    continue
                stopped = self.budget.why_not(share)
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
        # every setting seen has a scored trial, so its best score is a number
        ordered = sorted(seen.values(), key=lambda s: self._best_score(s) or 0.0, reverse=True)
        chosen = {settings_key(self.defaults): self.defaults}
        for settings in [self._descent_best, *ordered]:
            if len(chosen) >= self.finalists:
                break
            chosen.setdefault(settings_key(settings), settings)
        return list(chosen.values())

    def _finals(self, stopped: str | None) -> str | None:
        if stopped and not self.trials:
            return stopped
        finalists = self._final_list = self._finalist_settings()
        # Rounds, the defaults first in each (D A B D A B ...): every finalist is measured
        # next to the defaults, under the same load, `repeats` times.
        for _ in range(self.repeats):
            for settings in finalists:
                why = self.budget.why_not()
                if why:
                    return stopped or why
                self._run(settings, "repeat")
        return stopped

    def _ranking(self) -> list[Ranked]:
        groups: dict[tuple, Ranked] = {}
        for trial in self.trials:
            group = groups.setdefault(settings_key(trial.settings),
                                      Ranked(trial.settings, [], []))
            group.trials.append(trial)
            if trial.score is not None:
                group.scores.append(trial.score)
        # The finalists (measured again, side by side) rank first, by their finals' median;
        # a setting measured once in the search, however lucky, only after them; failed last.
        final_keys = {settings_key(s) for s in self._final_list}

        def place(group: Ranked) -> tuple[int, float]:
            if not group.scores:
                return 2, 0.0
            if settings_key(group.settings) not in final_keys:
                return 1, -group.median
            scores = [t.score for t in group.trials if t.role == "repeat" and t.score is not None]
            return 0, -statistics.median(scores or group.scores)

        return sorted(groups.values(), key=place)


def paired_malloc(rounds: list[tuple[float, float]]) -> dict[str, Any]:
    """malloc=default beside malloc=raised, each round's (default, raised) scores (launch/tune.py):
    raised wins by the finals' rule (None: too few rounds to tell); the ratio is paired per round,
    so a drift of the machine touches both sides alike."""
    default, raised = [d for d, _ in rounds], [r for _, r in rounds]
    ratios = [r / d for d, r in rounds if d > 0]
    wins = min(raised) > max(default) if len(rounds) >= MIN_FINAL_SCORES else None
    return {"default_scores_mib_s": default, "raised_scores_mib_s": raised, "ratios": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "raised_wins": wins, "chosen": "raised" if wins else "default"}
