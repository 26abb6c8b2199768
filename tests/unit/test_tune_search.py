"""The tune search (tune/search.py) against a fake trial function and a fake clock."""

from __future__ import annotations

import pytest

from dcp_fsdp.tune.search import Budget, Search, Trial, settings_key

SPACE: dict[str, list] = {"threads": [1, 2, 4, 8], "part": [8, 16, 32], "reader": ["a", "b"]}
DEFAULTS = {"threads": 1, "part": 8, "reader": "a"}


class FakeRuns:
    """Scores from a formula (plus optional per-call noise); each trial costs `cost_s`."""

    def __init__(self, score, cost_s: float = 10.0, noise=None, fail=()):
        self.score = score
        self.cost_s = cost_s
        self.noise = list(noise or [])
        self.fail = {settings_key(s) for s in fail}
        self.now = 0.0
        self.calls: list[tuple[dict, str]] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, settings, role) -> Trial:
        self.calls.append((settings, role))
        self.now += self.cost_s
        if settings_key(settings) in self.fail:
            return Trial(settings, role, None, self.cost_s)
        value = self.score(settings) * (1 + (self.noise.pop(0) if self.noise else 0.0))
        return Trial(settings, role, value, self.cost_s, {"save_mib_s": value, "load_mib_s": value})


def peak(settings) -> float:
    """Best at threads=4, part=16, reader=b; each setting matters independently."""
    return (100 + {1: 0, 2: 30, 4: 50, 8: 40}[settings["threads"]]
            + {8: 0, 16: 20, 32: 10}[settings["part"]] + {"a": 0, "b": 15}[settings["reader"]])


def search(runs: FakeRuns, budget_s=10_000.0, trials=None, repeats=3, **kwargs) -> Search:
    return Search(SPACE, DEFAULTS, runs, Budget(budget_s, trials, 0.0, clock=runs.clock),
                  repeats, **kwargs)


def test_coordinate_descent_finds_the_separable_optimum_with_fewer_trials_than_the_grid():
    runs = FakeRuns(peak)
    result = search(runs).run()
    assert result.best.settings == {"threads": 4, "part": 16, "reader": "b"}
    grid = 4 * 3 * 2
    search_trials = [t for t in result.trials if t.role in ("defaults", "search")]
    assert len(search_trials) == 1 + 3 + 2 + 1 < grid
    assert result.searched == ["threads", "part", "reader"] and result.stopped is None
    assert result.gain == pytest.approx(peak(result.best.settings) / peak(DEFAULTS) - 1)


def test_finals_interleave_the_defaults_with_the_candidates_in_rounds():
    runs = FakeRuns(peak)
    result = search(runs, repeats=3).run()
    finals = [(s, role) for s, role in runs.calls if role == "repeat"]
    assert len(finals) == 3 * len(result.finalists) and len(result.finalists) == 3
    # D A B D A B D A B: the defaults open every round, each finalist once per round
    rounds = [finals[i:i + 3] for i in range(0, len(finals), 3)]
    assert all([s for s, _ in r] == result.finalists for r in rounds)
    assert result.finalists[0] == DEFAULTS
    assert all(len(result.final_scores(s)) == 3 for s in result.finalists)
    ranked = result.ranking[:3]
    medians = [sorted(result.final_scores(r.settings))[1] for r in ranked]
    assert medians == sorted(medians, reverse=True)


def test_a_lucky_single_measurement_does_not_win():
    """threads=2 (truly 130) is measured once at +80 %: the descent follows it, but the
    finals measure it again and a setting that is really better ranks first."""
    lucky = {**DEFAULTS, "threads": 2}
    runs = FakeRuns(peak, noise=[0.0, 0.8])  # the defaults, then threads=2
    result = search(runs, repeats=3).run()
    ranked = result.of(lucky)
    assert ranked is not None and ranked.median == pytest.approx(peak(lucky))
    assert result.best.settings != lucky
    assert result.best.median > peak(lucky) and len(result.final_scores(result.best.settings)) == 3


def test_margin_keeps_the_current_value_against_a_tiny_gain():
    runs = FakeRuns(lambda s: 100 + (1 if s["threads"] == 2 else 0))
    result = search(runs, margin=0.03).run()
    assert result.best.settings["threads"] in (1, 2)
    # the descent did not move to threads=2 (1 % < 3 %): the next settings were tried at threads=1
    part_trials = [s for s, role in runs.calls if role == "search" and s["part"] != 8]
    assert part_trials and all(s["threads"] == 1 for s in part_trials)


def test_budget_is_never_overrun_by_a_trial_that_was_estimated_to_fit():
    runs = FakeRuns(peak, cost_s=10.0)
    result = search(runs, budget_s=75.0).run()
    assert runs.now <= 75.0
    assert len(result.trials) == 7
    assert result.stopped and "budget_s" in result.stopped
    # the search used 60 % (4 trials of 10 s in 45 s), then the finals: one round of the
    # three finalists, defaults first
    assert [role for _, role in runs.calls].count("repeat") == 3
    assert runs.calls[4][0] == DEFAULTS
    # one final round is too few to tell a winner from noise: keep the defaults
    assert result.recommended is None and result.best.settings == DEFAULTS


def test_budget_estimate_follows_the_trials_cost():
    budget = Budget(100.0, None, 0.0, clock=lambda: 50.0)
    assert budget.why_not() is None  # nothing known yet: the first trial always starts
    budget.walls = [20.0, 20.0, 40.0]
    assert budget.estimate_s() == 40.0  # the latest is larger than the median
    assert budget.why_not() is None  # 50 + 40 <= 100
    assert budget.why_not(share=0.6) is not None  # 50 + 40 > 60


def test_trials_cap_counts_every_run():
    runs = FakeRuns(peak)
    result = search(runs, trials=5).run()
    assert len(result.trials) == 5 and "tune.trials=5" in (result.stopped or "")


def test_a_failing_setting_is_skipped_and_ranked_last():
    bad = {**DEFAULTS, "threads": 2}
    runs = FakeRuns(peak, fail=[bad])
    result = search(runs).run()
    assert result.best.settings == {"threads": 4, "part": 16, "reader": "b"}
    assert result.ranking[-1].settings == bad and result.ranking[-1].scores == []


def test_failing_defaults_stop_the_search():
    runs = FakeRuns(peak, fail=[DEFAULTS])
    with pytest.raises(RuntimeError, match="defaults failed"):
        search(runs).run()
    assert len(runs.calls) == 1


def test_nothing_to_tune_measures_the_defaults_repeats_times():
    runs = FakeRuns(peak)
    result = Search({}, DEFAULTS, runs, Budget(1000.0, None, 0.0, clock=runs.clock), 3).run()
    assert [role for _, role in runs.calls] == ["defaults", "repeat", "repeat", "repeat"]
    assert result.best.settings == DEFAULTS and result.gain == 0.0
    assert result.noise == 0.0


def test_tune_never_recommends_a_setting_that_lost_to_the_defaults():
    """part=16 wins the search (+10 %, one lucky measurement) and has the higher median in
    the finals, but in one final round it lost to the defaults: within the noise, so the
    answer is the defaults."""
    space: dict[str, list] = {"part": [8, 16]}
    defaults = {"part": 8}
    # defaults, part=16 (search); then rounds D A: (100, 103) (100, 104) (101, 98)
    scores = iter([100.0, 110.0, 100.0, 103.0, 100.0, 104.0, 101.0, 98.0])
    runs = FakeRuns(lambda s: next(scores))
    result = Search(space, defaults, runs, Budget(10_000.0, None, 0.0, clock=runs.clock),
                    3).run()
    assert [role for _, role in runs.calls] == ["defaults", "search"] + ["repeat"] * 6
    assert result.recommended is None
    assert result.best.settings == defaults
    assert result.gain == 0.0
    assert result.noise == pytest.approx((101 - 100) / 100)


def test_a_winner_beyond_the_spread_is_recommended():
    space: dict[str, list] = {"part": [8, 16]}
    defaults = {"part": 8}
    scores = iter([100.0, 120.0, 100.0, 118.0, 103.0, 121.0, 99.0, 119.0])
    runs = FakeRuns(lambda s: next(scores))
    result = Search(space, defaults, runs, Budget(10_000.0, None, 0.0, clock=runs.clock),
                    3).run()
    assert result.recommended == {"part": 16}
    assert result.best.settings == {"part": 16}
    assert result.gain == pytest.approx(119 / 100 - 1)


def test_a_setting_that_needs_another_value_is_searched_only_under_it():
    """The reader's gap size means nothing to a reader that has none: once the descent
    moves to reader=b, no gap value is tried."""
    space: dict[str, list] = {"reader": ["a", "b"], "gap": [32, 0, 128]}
    defaults = {"reader": "a", "gap": 32}
    runs = FakeRuns(lambda s: 200 if s["reader"] == "b" else 100)
    result = Search(space, defaults, runs, Budget(10_000.0, None, 0.0, clock=runs.clock), 2,
                    requires={"gap": ("reader", "a")}).run()
    searched = [s for s, role in runs.calls if role == "search"]
    assert searched == [{"reader": "b", "gap": 32}]
    assert result.recommended == {"reader": "b", "gap": 32}


def test_the_printed_verdict_keeps_the_defaults_and_shows_the_noise(tmp_path, capsys):
    from dcp_fsdp.tune.report import print_result, result_summary

    space: dict[str, list] = {"storage.reader": ["dcp_optimized", "sequential"],
             "storage.max_gap_size_mib": [32.0, 0.0]}
    defaults = {"storage.reader": "dcp_optimized", "storage.max_gap_size_mib": 32.0}
    requires = {"storage.max_gap_size_mib": ("storage.reader", "dcp_optimized")}
    # defaults 100, sequential 130 in the search; finals D A: (100, 104) (110, 105) (90, 99)
    scores = iter([100.0, 130.0, 100.0, 104.0, 110.0, 105.0, 90.0, 99.0])
    runs = FakeRuns(lambda s: next(scores))
    result = Search(space, defaults, runs, Budget(10_000.0, None, 0.0, clock=runs.clock), 3,
                    requires=requires).run()
    print_result(result_summary(result, 12.0, tmp_path, requires))
    out = capsys.readouterr().out
    assert "recommended: keep the defaults" in out
    assert "noise seen: the defaults' final scores spread 20 % (90.0..110.0 MiB/s" in out
    assert out.rstrip().endswith(
        "OVERRIDES=storage.reader=dcp_optimized storage.max_gap_size_mib=32.0")


def test_an_override_line_leaves_out_a_setting_without_effect(tmp_path, capsys):
    from dcp_fsdp.tune.report import print_result, result_summary

    space: dict[str, list] = {"storage.reader": ["dcp_optimized", "sequential"],
             "storage.max_gap_size_mib": [32.0, 0.0]}
    defaults = {"storage.reader": "dcp_optimized", "storage.max_gap_size_mib": 32.0}
    requires = {"storage.max_gap_size_mib": ("storage.reader", "dcp_optimized")}
    runs = FakeRuns(lambda s: 200.0 if s["storage.reader"] == "sequential" else 100.0)
    result = Search(space, defaults, runs, Budget(10_000.0, None, 0.0, clock=runs.clock), 3,
                    requires=requires).run()
    print_result(result_summary(result, 12.0, tmp_path, requires))
    out = capsys.readouterr().out
    assert "recommended: storage.reader=sequential" in out
    assert out.rstrip().endswith("OVERRIDES=storage.reader=sequential")


def test_a_slow_start_up_leaves_the_search_its_share_of_the_time_left():
    """90 s of a 120 s budget spent starting the ranks: the search still gets 60 % of the
    30 s left, not nothing (the finals would otherwise re-measure the defaults alone)."""
    runs = FakeRuns(peak, cost_s=2.0)
    runs.now = 90.0
    result = search(runs, budget_s=120.0, repeats=2).run()
    roles = [role for _, role in runs.calls]
    assert roles.count("search") >= 5
    assert runs.now <= 120.0
    assert len(result.finalists) == 3


def test_the_efficiency_trials_reserve_comes_off_the_finals_not_the_search():
    """6 trials' worth kept for the efficiency trial: the search keeps its whole share, the
    finals stop early enough that the reserve still fits the budget afterwards."""
    plain, kept = FakeRuns(peak, cost_s=10.0), FakeRuns(peak, cost_s=10.0)
    search(plain, budget_s=180.0).run()
    budget = Budget(180.0, None, 0.0, clock=kept.clock)
    budget.reserve_trials = 6.0
    Search(SPACE, DEFAULTS, kept, budget, 3).run()
    roles = [[role for _, role in runs.calls] for runs in (plain, kept)]
    assert roles[0].count("search") == roles[1].count("search") > 0
    assert roles[1].count("repeat") < roles[0].count("repeat")
    assert budget.reserve_fits() and kept.now + 6 * 10.0 <= 180.0


def test_the_efficiency_lines_say_the_ceiling_its_noise_or_why_there_is_none():
    from dcp_fsdp.tune.report import ceiling_summary, efficiency_lines

    figures = {"save_mib_s": 40.0, "load_mib_s": 300.0, "raw_put_best_mib_s": 50.0,
               "raw_get_best_mib_s": 250.0, "raw_put_spread": 0.2, "raw_get_spread": 0.1,
               "save_efficiency": 0.8, "load_efficiency": 1.2, "record": "r.jsonl",
               "status": "ok", "error": None}
    lines = efficiency_lines({"trial": ceiling_summary(Trial(DEFAULTS, "ceiling", 1.0, 5.0,
                                                              figures))})
    assert "save 40.0 of 50.0 MiB/s (0.80, raw rounds spread 20 %)" in lines[0]
    assert "load 300.0 of 250.0 MiB/s (1.20, raw rounds spread 10 %)" in lines[0]
    assert "above 1 (load)" in lines[1]
    failed = {"record": "f.jsonl", "status": "failed", "error": "rank 1: ConnectionError"}
    (line,) = efficiency_lines({"trial": ceiling_summary(Trial(DEFAULTS, "ceiling", None, 5.0,
                                                                failed))})
    assert "its trial failed (rank 1: ConnectionError; record f.jsonl)" in line
    (line,) = efficiency_lines({})
    assert "not measured" in line and "tune.budget_s" in line


def test_a_setting_of_one_client_applies_only_with_that_client():
    """storage.client is tuned: the connector's settings, and the reader's gap size on top
    of its reader, are searched and printed only while the connector is the client."""
    from dcp_fsdp.launch.tune import REQUIRES
    from dcp_fsdp.tune.search import applies

    connector = {"storage.client": "s3torchconnector", "storage.reader": "dcp_optimized"}
    fsspec = {**connector, "storage.client": "fsspec"}
    for name in ("storage.part_size_mib", "storage.reader", "storage.max_gap_size_mib"):
        assert applies(name, connector, REQUIRES) and not applies(name, fsspec, REQUIRES)
    assert not applies("storage.max_gap_size_mib", {**connector, "storage.reader": "sequential"},
                       REQUIRES)
    assert applies("storage.thread_count", fsspec, REQUIRES)


def test_the_client_is_tuned_unless_a_client_setting_or_the_process_checkpointer_fixes_it():
    from dcp_fsdp.config.compose import check_overrides, compose
    from dcp_fsdp.launch.tune import search_space

    def tuned(*overrides: str) -> dict:
        return search_space(compose("save-and-load", list(overrides)),
                            check_overrides(list(overrides)))[0]

    assert tuned("storage.uri=s3://bench/p")["storage.client"][0] == "s3torchconnector"
    assert "storage.client" not in tuned("storage.uri=s3://bench/p", "storage.part_size_mib=16")
    assert "storage.client" not in tuned("storage.uri=s3://bench/p", "save_mode=async",
                                         "async_save.checkpointer=process")
    assert "storage.client" not in tuned("storage.uri=s3://bench/p", "storage.client=msc")
