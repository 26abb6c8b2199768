"""How the launcher reads torch's elastic agent's report (per-rank exit codes and error
files) into an exit code, a status and one line, and corrects a record a stopped rank
wrote. No processes: the agent's summary as it writes it."""

from __future__ import annotations

import json
import signal

import pytest

from dcp_fsdp import contract
from dcp_fsdp.launch import aftermath
from dcp_fsdp.launch.aftermath import RanksOutcome
from dcp_fsdp.launch.local import _outcome


def failure(exitcode, message="", timestamp=100, signal_name=None, cause=None, error=None):
    """One rank's entry of the agent's summary; `cause` and `error` are what our rank wrote
    in its error file (absent when torch's own record() or nothing wrote it)."""
    entry = {"local_rank": 0, "pid": 1, "exitcode": exitcode, "signal": signal_name,
             "message": message, "timestamp": timestamp}
    if cause is not None:
        entry.update(status="failed", cause=cause, error=error)
    return entry


def test_a_killed_rank_is_the_root_cause_not_the_rank_it_stopped():
    summary = {"outcome": "failed", "failures": {
        "0": failure(1, "whatever it says", timestamp=99, cause="peer_ended", error="stopped"),
        "1": failure(-9, "Signal 9 (SIGKILL) received by PID 7", 101, "SIGKILL")}}
    outcome = _outcome(1, summary, None)
    assert (outcome.exit_code, outcome.status) == (contract.EXIT_FAILED, "failed")
    assert outcome.error is not None
    assert outcome.error.startswith("rank 1 was killed by SIGKILL (out of memory is the likely cause")
    assert outcome.cause is contract.EndCause.KILLED


def test_the_cause_is_decided_on_the_field_never_on_the_wording():
    """A rank whose own error happens to read like ours ("stopped after rank ...") is still
    the root cause; a stopped one is not, whatever its text."""
    summary = {"outcome": "failed", "failures": {
        "0": failure(1, "failed: x", timestamp=99, cause="peer_ended", error="reworded entirely"),
        "1": failure(1, "failed: y", timestamp=101, cause="error",
                     error="stopped after rank 9 (a storage message that reads like ours)")}}
    outcome = _outcome(1, summary, None)
    assert outcome.error == "rank 1: stopped after rank 9 (a storage message that reads like ours)"
    assert outcome.cause is contract.EndCause.ERROR
    # torch's own record() (no fields of ours): the exit code and torch's text
    plain = _outcome(1, {"outcome": "failed", "failures": {"3": failure(7, "RuntimeError: boom")}}, None)
    assert (plain.error, plain.cause) == ("rank 3 exited with 7: RuntimeError: boom", contract.EndCause.ERROR)


def test_a_record_a_stopped_rank_wrote_takes_the_root_cause_by_its_field(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"record": "run", "status": "failed", "end_cause": "peer_ended",
                                "error": "any wording at all"}) + "\n")
    outcome = RanksOutcome(1, "failed", "rank 1 was killed by SIGKILL", cause=contract.EndCause.KILLED)
    run, replaced = aftermath._amend(path, outcome)
    assert replaced and run["error"] == "rank 1 was killed by SIGKILL" and run["end_cause"] == "killed"
    assert json.loads(path.read_text().splitlines()[0])["end_cause"] == "killed"


def test_a_rank_error_keeps_its_exit_code_and_line():
    summary = {"outcome": "failed", "failures": {
        "0": failure(2, "failed: suffix=x: bad", cause="user_error", error="suffix=x: bad")}}
    outcome = _outcome(1, summary, None)
    assert (outcome.exit_code, outcome.error) == (contract.EXIT_USER_ERROR, "rank 0: suffix=x: bad")
    assert outcome.cause is contract.EndCause.USER_ERROR


def test_the_parents_signal_makes_it_an_interrupt():
    outcome = _outcome(130, {"outcome": "interrupted", "signal": "SIGTERM"}, signal.SIGINT)
    assert (outcome.exit_code, outcome.status, outcome.error) == (
        contract.EXIT_INTERRUPTED, "interrupted", "interrupted by SIGINT")
    assert _outcome(0, {}, None).status == "ok"
    assert _outcome(-9, {}, None).status == "failed"  # the agent died without a word


def test_a_record_from_a_stopped_rank_is_corrected(tmp_path):
    path = tmp_path / "r.jsonl"
    sample = {"record": "sample", "op": "save"}
    path.write_text(json.dumps({"record": "run", "status": "interrupted",
                                "error": "interrupted by SIGTERM"}) + "\n"
                    + json.dumps(sample) + "\n")
    outcome = RanksOutcome(1, "failed", "rank 1 was killed by SIGKILL", writing_suffix="s1",
                           cause=contract.EndCause.KILLED)
    aftermath._amend(path, outcome)
    run, kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert run["status"] == "failed" and run["error"].startswith("rank 1 was killed by SIGKILL")
    assert run["incomplete_suffix"] == "s1" and "_replaced_root_cause" not in run
    assert kept == sample


def test_every_outcome_keeps_failures_apart_from_the_suffix(tmp_path):
    """The slip a type checker now catches: the failures dict passed positionally into
    `writing_suffix`. Each outcome with failures keeps them in `failures`, the suffix
    stays a string or None, and the record the parent amends says so."""
    failures = {"0": failure(1, "failed: stopped ...", cause="peer_ended", error="stopped ..."),
                "1": failure(-9, "Signal 9 (SIGKILL) received by PID 7", 101, "SIGKILL")}
    cases = [
        _outcome(1, {"outcome": "failed", "failures": failures}, None),
        _outcome(130, {"outcome": "interrupted", "failures": failures}, signal.SIGTERM),
        _outcome(130, {"outcome": "interrupted", "signal": "SIGINT", "failures": failures}, None),
        _outcome(1, {"outcome": "failed", "failures": {"0": failure(130, "interrupted")}}, None),
        _outcome(1, {"outcome": "failed", "failures": {"0": failure(3, "failed: x: y", cause="error",
                                                                     error="x: y")}}, None),
    ]
    for outcome in cases:
        assert outcome.writing_suffix is None
        assert outcome.failures and all(isinstance(v, dict) for v in outcome.failures.values())
    for writing_suffix in ("s7", None):
        path = tmp_path / f"{writing_suffix}.jsonl"
        path.write_text(json.dumps({"record": "run", "status": "failed", "error": "x"}) + "\n")
        outcome = cases[0]
        outcome.writing_suffix = writing_suffix
        aftermath._amend(path, outcome)
        run = json.loads(path.read_text().splitlines()[0])
        assert run.get("incomplete_suffix") == writing_suffix  # a string or null, never a dict
        assert run["rank_failures"]["1"]["signal"] == "SIGKILL"


@pytest.mark.parametrize("node_oom_kills, says", [
    (2, "rank 1 was killed by SIGKILL (out of memory: the kernel's OOM killer killed 2 "
        "process(es) on its node during the run; `dmesg` names them)"),
    (0, "rank 1 was killed by SIGKILL (not the kernel's OOM killer: it killed nothing on that "
        "node during the run, /proc/vmstat oom_kill; a person or another process sent it)"),
    (None, "rank 1 was killed by SIGKILL (out of memory is the likely cause"),
])
def test_a_sigkill_names_the_oom_killer_only_when_its_node_counted_one(node_oom_kills, says):
    """A kill -9 (a person, a test, a scheduler's cleanup) was reported as "out of memory is
    the likely cause"; the agent now counts the kernel's OOM kills on its node while the ranks
    ran, and the line says which it was (None: an agent or a kernel that does not say)."""
    entry = failure(-9, "Signal 9 (SIGKILL) received by PID 7", 101, "SIGKILL")
    entry["node_oom_kills"] = node_oom_kills
    outcome = _outcome(1, {"outcome": "failed", "failures": {"1": entry}}, None)
    assert outcome.error is not None and outcome.error.startswith(says)
    assert outcome.cause is contract.EndCause.KILLED


def test_the_kernels_oom_kill_count_is_read_from_vmstat(tmp_path):
    from dcp_fsdp.process.oom_kills import oom_kills, oom_kills_since

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 123\noom_kill 4\npgfault 9\n")
    assert oom_kills(str(vmstat)) == 4
    vmstat.write_text("nr_free_pages 123\noom_kill 7\n")
    assert oom_kills_since(4, str(vmstat)) == 3
    assert oom_kills_since(None, str(vmstat)) is None
    vmstat.write_text("nr_free_pages 123\n")  # a kernel before 4.13
    assert oom_kills(str(vmstat)) is None and oom_kills_since(4, str(vmstat)) is None
    assert oom_kills(str(tmp_path / "absent")) is None
