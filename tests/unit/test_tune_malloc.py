"""tune's malloc launches after the search (launch/tune.py): malloc=default and malloc=raised
launched in turn, raised chosen by the finals' rule, said in the malloc line, tune.json and
the OVERRIDES= line; held when given; a line with the budget it needed when there is no room.
The launches are faked (no ranks)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dcp_fsdp import contract
from dcp_fsdp.config.compose import check_overrides, compose
from dcp_fsdp.launch import tune as launcher
from dcp_fsdp.tune.report import malloc_lines
from dcp_fsdp.tune.search import paired_malloc
from tests.unit.analysis_kit import ONE_ITERATION, variant

RECOMMENDED = {"storage.thread_count": 4, "plan_caching": False}


def test_raised_wins_only_when_each_of_its_scores_beats_every_default_score():
    found = paired_malloc([(100.0, 150.0), (110.0, 140.0), (90.0, 160.0)])
    assert found["raised_wins"] is True and found["chosen"] == "raised"
    assert found["ratios"] == pytest.approx([1.5, 140 / 110, 160 / 90])
    assert found["ratio_median"] == pytest.approx(1.5)
    assert (found["ratio_min"], found["ratio_max"]) == pytest.approx((140 / 110, 160 / 90))
    # one round of raised below the default's best: noise, whatever the median
    overlap = paired_malloc([(100.0, 150.0), (150.0, 140.0), (90.0, 160.0)])
    assert overlap["raised_wins"] is False and overlap["chosen"] == "default"
    # one round is too few to tell, however large the gain
    single = paired_malloc([(100.0, 300.0)])
    assert single["raised_wins"] is None and single["chosen"] == "default"


def _session(tmp_path):
    summary = {"trials": [{"wall_s": 2.0}, {"wall_s": 3.0}, {"wall_s": 4.0}],
               "ceiling": {"trial": {"wall_s": 6.0}}, "overrides": dict(RECOMMENDED)}
    (tmp_path / "tune.json").write_text(json.dumps(summary))
    return tmp_path


class FakeLaunches:
    """_malloc_launch: each launch's score by its malloc value, in order."""

    def __init__(self, scores: dict[str, list[float]], code: dict[str, int] | None = None):
        self.scores = {k: list(v) for k, v in scores.items()}
        self.code = code or {}
        self.calls: list[tuple[dict, str]] = []

    def __call__(self, cfg, settings, malloc, output):
        self.calls.append((dict(settings), malloc))
        code = self.code.get(malloc, contract.EXIT_OK)
        figures = ({"save_mib_s": 1.0, "load_mib_s": 1.0, "score_mib_s": self.scores[malloc].pop(0)}
                   if code == contract.EXIT_OK else {})
        return launcher.MallocLaunch(code, f"rec-{len(self.calls)}.jsonl", figures,
                                     checkpoint="its checkpoint s deleted by tune",
                                     output=None if code == contract.EXIT_OK else str(output))


def _after(tmp_path, monkeypatch, fake, overrides=(), budget_s=600, spent_s=0.0, search_s=20.0):
    monkeypatch.setattr(launcher, "_malloc_launch", fake)
    cfg = compose("save-and-load", [f"tune.budget_s={budget_s}", "tune.repeats=3", *overrides])
    held = launcher._malloc_held(cfg, check_overrides(list(overrides)))
    code = launcher._after_search(cfg, _session(tmp_path), held, time.monotonic() - spent_s,
                                  search_s)
    return code, json.loads((tmp_path / "tune.json").read_text())


def test_the_recommendation_runs_default_then_raised_each_round_and_raised_wins(
        tmp_path, monkeypatch, capsys):
    fake = FakeLaunches({"default": [100.0, 104.0, 98.0], "raised": [190.0, 201.0, 185.0]})
    code, summary = _after(tmp_path, monkeypatch, fake)
    assert code == contract.EXIT_OK
    assert [m for _, m in fake.calls] == ["default", "raised"] * 3  # tune.repeats rounds
    assert all(settings == RECOMMENDED for settings, _ in fake.calls)
    found = summary["malloc"]
    assert found["status"] == "measured" and found["raised_wins"] is True
    assert found["records"] == [f"rec-{n}.jsonl" for n in range(1, 7)]
    assert summary["overrides"] == {**RECOMMENDED, "malloc": "raised"}
    out = capsys.readouterr().out
    assert "malloc: raised wins beyond the noise" in out
    assert "paired ratio raised/default 1.90 (1.89..1.93 over 3 rounds" in out
    assert out.rstrip().splitlines()[-1] == (
        "OVERRIDES=storage.thread_count=4 plan_caching=False malloc=raised")


def test_raised_within_the_noise_keeps_the_default(tmp_path, monkeypatch, capsys):
    fake = FakeLaunches({"default": [100.0, 130.0, 98.0], "raised": [120.0, 110.0, 125.0]})
    code, summary = _after(tmp_path, monkeypatch, fake)
    assert code == contract.EXIT_OK and summary["malloc"]["raised_wins"] is False
    assert summary["overrides"]["malloc"] == "default"
    out = capsys.readouterr().out
    assert "malloc: keep the default: raised did not beat it beyond the noise" in out
    assert out.rstrip().endswith("malloc=default")


def test_a_given_malloc_is_held_and_nothing_is_launched(tmp_path, monkeypatch, capsys):
    fake = FakeLaunches({})
    code, summary = _after(tmp_path, monkeypatch, fake, overrides=["malloc=raised"])
    assert code == contract.EXIT_OK and fake.calls == []
    assert summary["malloc"] == {"status": "held", "chosen": "raised"}
    out = capsys.readouterr().out
    assert "malloc:" not in out
    assert out.rstrip().endswith("OVERRIDES=storage.thread_count=4 plan_caching=False malloc=raised")


def test_no_room_says_in_one_line_what_budget_it_needed(tmp_path, monkeypatch, capsys):
    # search launch 20 s, its trials 9 s and the efficiency trial 6 s: start-up ~5 s, so a
    # launch ~8 s (5 + the median trial, 3 s), 2 rounds of 2: 32 s; 10 s of 600 are left
    fake = FakeLaunches({})
    code, summary = _after(tmp_path, monkeypatch, fake, spent_s=590.0)
    assert code == contract.EXIT_OK and fake.calls == []
    found = summary["malloc"]
    assert found["status"] == "no_room" and found["chosen"] == "default"
    assert found["launch_s"] == pytest.approx(8.0)
    assert found["needed_s"] == pytest.approx(32.0)
    assert found["budget_needed_s"] == 128  # the share kept for it (25 %) covers 32 s
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("malloc")]
    assert lines == ["malloc: not measured: its paired launches (2 rounds of malloc=default and "
                     "malloc=raised, about 8 s a launch) need about 32 s, the budget had 10 s "
                     "left; give tune.budget_s=128 or more"]


def test_a_failed_launch_ends_the_phase_with_its_record(tmp_path, monkeypatch, capsys):
    fake = FakeLaunches({"default": [100.0]}, code={"raised": 1})
    code, summary = _after(tmp_path, monkeypatch, fake)
    assert code == contract.EXIT_OK and len(fake.calls) == 2
    assert summary["malloc"]["status"] == "failed" and summary["overrides"]["malloc"] == "default"
    assert ("its launch with malloc=raised failed (exit 1; record rec-2.jsonl; its output: "
            "results/malloc-round1-raised.log)") in capsys.readouterr().out


def test_an_interrupted_launch_stops_the_tune_and_the_verdict_stands(tmp_path, monkeypatch, capsys):
    fake = FakeLaunches({"default": [100.0]}, code={"raised": contract.EXIT_INTERRUPTED})
    code, summary = _after(tmp_path, monkeypatch, fake)
    assert code == contract.EXIT_INTERRUPTED and len(fake.calls) == 2
    assert "malloc" not in summary and "malloc" not in summary["overrides"]
    launcher._say_interrupted(tmp_path, 12.0)
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OVERRIDES=storage.thread_count=4 plan_caching=False")


def test_the_lines_say_too_few_rounds_without_a_verdict():
    found = {"status": "measured", **paired_malloc([(100.0, 200.0)])}
    (line,) = malloc_lines(found)
    assert line.startswith("malloc: keep the default: 1 round(s), too few to tell raised from noise")


# What a whole run prints at its end (the ranks' table, the record, the suffix lines), on the
# file descriptors the ranks inherit from the launcher.
RUN_OUTPUT = ("| op | iter | suffix |\n"
              "[dcp-fsdp] checkpoint 2026-11-23-10-31-ce08 was deleted with the embedded S3 "
              "server at exit; to save and then load, keep a server up\n")


class FakeLaunchLocal:
    """launch.local.launch_local: a record as a real run of one iteration wrote it (its
    checkpoint 2026-11-23-10-31-ce08), a whole run's output on fds 1 and 2, an exit code."""

    def __init__(self, code: int = contract.EXIT_OK):
        self.code = code
        self.mallocs: list[str] = []

    def __call__(self, cfg):
        self.mallocs.append(cfg.malloc.value)
        failed = self.code != contract.EXIT_OK
        variant(Path(cfg.results_dir), f"launch-{len(self.mallocs)}", ONE_ITERATION,
                settings={"malloc": cfg.malloc.value}, status="failed" if failed else "ok",
                error="rank 0: the storage went away" if failed else None)
        os.write(1, RUN_OUTPUT.encode())
        os.write(2, b"dcp-fsdp: warning: a rank's own warning\n")
        return self.code


class FakeStore:
    def __init__(self):
        self.deleted: list[str] = []

    def delete(self, suffix):
        self.deleted.append(suffix)


def _launch_for_real(tmp_path, monkeypatch, launch_local):
    """_after_search with the real _malloc_launch over a fake launch_local and store."""
    from dcp_fsdp import storage
    from dcp_fsdp.launch import local

    store = FakeStore()
    monkeypatch.setattr(local, "launch_local", launch_local)
    monkeypatch.setattr(storage, "make_store", lambda config: store)
    cfg = compose("save-and-load", ["tune.budget_s=600", "tune.repeats=2",
                                    f"results_dir={tmp_path}"])
    code = launcher._after_search(cfg, _session(tmp_path), None, time.monotonic(), 20.0)
    return code, store


def test_each_paired_launch_prints_one_line_and_tune_deletes_its_checkpoint(
        tmp_path, monkeypatch, capfd):
    fake = FakeLaunchLocal()
    code, store = _launch_for_real(tmp_path, monkeypatch, fake)
    assert code == contract.EXIT_OK and fake.mallocs == ["default", "raised"] * 2
    out, err = capfd.readouterr()
    # none of the launches' own output: the table, nor its false 'deleted with the
    # embedded S3 server at exit' (the tune's server lives on; tune deletes it)
    assert "| op |" not in out and "embedded S3 server" not in out + err, out
    assert "a rank's own warning" not in err, err
    lines = [line for line in out.splitlines() if "tune: malloc round" in line]
    assert len(lines) == 4, out
    for line, (number, malloc) in zip(lines, [(1, "default"), (1, "raised"), (2, "default"),
                                              (2, "raised")]):
        assert line.startswith(f"[dcp-fsdp] tune: malloc round {number}, malloc={malloc}: "
                               "save 31.8 MiB/s, load 46.9 MiB/s, score 37.9 MiB/s")
        assert line.endswith("; its checkpoint 2026-11-23-10-31-ce08 deleted by tune")
    assert "1.00x the default's" in lines[1] and "x the default's" not in lines[0]
    assert store.deleted == ["2026-11-23-10-31-ce08"] * 4
    assert not list(tmp_path.glob("*.log"))  # a launch that succeeded keeps no output
    os.write(1, b"after the launches\n")  # the terminal's descriptors are given back
    assert capfd.readouterr().out == "after the launches\n"


def test_a_failed_paired_launch_says_so_in_its_line_and_keeps_its_output(
        tmp_path, monkeypatch, capfd):
    code, store = _launch_for_real(tmp_path, monkeypatch, FakeLaunchLocal(contract.EXIT_FAILED))
    assert code == contract.EXIT_OK
    out, _ = capfd.readouterr()
    output = tmp_path / "malloc-round1-default.log"
    (line,) = [line for line in out.splitlines() if "tune: malloc round" in line]
    assert line.startswith("[dcp-fsdp] tune: malloc round 1, malloc=default: failed (exit 1: "
                           "rank 0: the storage went away; ")
    assert line.endswith(f"its checkpoint 2026-11-23-10-31-ce08 deleted by tune; its output: "
                         f"{output}")
    assert RUN_OUTPUT in output.read_text()
    assert store.deleted == ["2026-11-23-10-31-ce08"]
    summary = json.loads((tmp_path / "tune.json").read_text())
    assert summary["malloc"]["status"] == "failed" and summary["malloc"]["output"] == str(output)


def test_an_interrupted_paired_launch_says_so_in_one_line_and_keeps_no_output(
        tmp_path, monkeypatch, capfd):
    code, store = _launch_for_real(tmp_path, monkeypatch,
                                   FakeLaunchLocal(contract.EXIT_INTERRUPTED))
    assert code == contract.EXIT_INTERRUPTED
    out, _ = capfd.readouterr()
    (line,) = [line for line in out.splitlines() if "tune: malloc round" in line]
    assert line.startswith("[dcp-fsdp] tune: malloc round 1, malloc=default: interrupted (")
    assert line.endswith("; its checkpoint 2026-11-23-10-31-ce08 deleted by tune")
    assert store.deleted == ["2026-11-23-10-31-ce08"] and not list(tmp_path.glob("*.log"))


@pytest.mark.parametrize("embedded", [True, False])
def test_a_checkpoint_tune_could_not_delete_is_named_with_what_becomes_of_it(
        tmp_path, monkeypatch, embedded):
    class RefusingStore:
        def delete(self, suffix):
            raise OSError("connection refused")

    from dcp_fsdp import storage

    monkeypatch.setattr(storage, "make_store", lambda config: RefusingStore())
    if embedded:
        monkeypatch.setenv(contract.EMBEDDED_ENV, "1")
    else:
        monkeypatch.delenv(contract.EMBEDDED_ENV, raising=False)
    cfg = compose("save-and-load", [])
    said = launcher._delete_checkpoints(cfg, ["s1"])
    assert said.startswith("its checkpoint s1 could not be deleted (connection refused): ")
    assert said.endswith("it goes with the tune's embedded S3 server at its exit" if embedded
                         else "`dcp-fsdp delete suffix=s1` with the same storage settings removes it")
