"""The aftermath of a Slurm job's step (dcp_fsdp/launch/after_job.py): the first cause and
the docs' exit code from what the nodes' tasks left in the job's directory, as
batch/node_task.sh and torch's agent write it (files, no processes). The Slurm cluster
test (tests/integration/test_slurm.py) makes each of these happen for real."""

from __future__ import annotations

import json
from pathlib import Path

from dcp_fsdp import contract
from dcp_fsdp.launch.after_job import job_outcome, node_reports, srun_task_ends


def node(job_dir: Path, number: int, host: str, summary: dict | None = None,
         agent_exit: tuple[int, int] | None = None, error_file: dict | None = None,
         error_time_s: int = 0) -> None:
    """What one node's task leaves: its host, the agent's outcome, the task's exit line."""
    path = job_dir / f"node-{number}"
    path.mkdir(parents=True)
    (path / "host").write_text(host + "\n")
    if summary is not None:
        (path / "agent.json").write_text(json.dumps(summary))
    if agent_exit is not None:
        (path / "agent-exit").write_text(f"{agent_exit[0]} {agent_exit[1]} {host}\n")
    if error_file is not None:
        rank_dir = path / "torchelastic" / "7_abc" / "attempt_0" / "0"
        rank_dir.mkdir(parents=True)
        (rank_dir / "error.json").write_text(json.dumps(
            {"message": "x", "timestamp": error_time_s, contract.ERROR_FILE_KEY: error_file}))


def rank_failure(exitcode: int, timestamp: int, cause: str | None = None,
                 error: str | None = None, signal_name: str | None = None) -> dict:
    entry = {"local_rank": 0, "pid": 1, "exitcode": exitcode, "signal": signal_name,
             "message": "", "timestamp": timestamp}
    if cause:
        entry.update(status="failed", cause=cause, error=error)
    return entry


def outcome_of(job_dir: Path, step_exit: int = 1, signal_name: str | None = None):
    return job_outcome(node_reports(job_dir), srun_task_ends(job_dir), step_exit, signal_name)


def test_a_killed_agent_is_the_cause_not_the_zip_error_it_caused(tmp_path):
    """kill -9 of node2's agent: its ranks' writes are cut short and a rank reports torch's
    zip error in the same second; the record must name the killed agent."""
    node(tmp_path, 0, "node1", {"outcome": "failed", "failures": {"0": rank_failure(
        1, 1000, "error", "RuntimeError: [enforce fail at inline_container.cc:672] . "
        "unexpected pos 704 vs 598")}}, (1, 1001))
    node(tmp_path, 1, "node2", None, (137, 1000))
    outcome = outcome_of(tmp_path)
    assert outcome.error == "node2: the node's torchrun agent was killed by SIGKILL"
    assert (outcome.exit_code, outcome.status, outcome.cause) == (
        contract.EXIT_FAILED, "failed", contract.EndCause.KILLED)


def test_a_killed_rank_on_another_node_is_the_cause(tmp_path):
    """The surviving node's rank took the step's SIGTERM for an interrupt."""
    node(tmp_path, 0, "node1", {"outcome": "failed", "failures": {"0": rank_failure(
        130, 999, "interrupted", "interrupted by SIGTERM")}}, (1, 1002))
    node(tmp_path, 1, "node2", {"outcome": "failed", "failures": {"1": rank_failure(
        -9, 1000, signal_name="SIGKILL")}}, (1, 1001))
    outcome = outcome_of(tmp_path)
    assert outcome.error.startswith("rank 1 was killed by SIGKILL (out of memory") and outcome.exit_code == 1
    assert set(outcome.failures) == {"0", "1"}


def test_a_node_killed_whole_is_named_from_srun(tmp_path):
    (tmp_path / "node-0").mkdir()  # its task was killed before writing anything
    (tmp_path / "node-0" / "host").write_text("node1\n")
    node(tmp_path, 1, "node2", {"outcome": "failed", "failures": {"1": rank_failure(
        1, 1000, "error", "Connection closed by peer")}}, (1, 1001))
    (tmp_path / "srun.err").write_text("rank noise\nsrun: error: node1: task 0: Killed\n"
                                       "srun: error: node2: task 1: Exited with exit code 1\n")
    assert srun_task_ends(tmp_path) == [("node1", "Killed"), ("node2", "Exited with exit code 1")]
    outcome = outcome_of(tmp_path, step_exit=137)
    assert outcome.error.startswith("node1: the node's task ended (Killed, says srun)")
    assert outcome.exit_code == contract.EXIT_FAILED


def test_scancel_and_the_time_limit_are_interrupts(tmp_path):
    node(tmp_path, 0, "node1", {"outcome": "interrupted", "signal": "SIGTERM"}, (130, 1000))
    cancelled = outcome_of(tmp_path, 130, "SIGTERM")
    assert (cancelled.exit_code, cancelled.status, cancelled.error) == (
        contract.EXIT_INTERRUPTED, "interrupted", "interrupted by SIGTERM")
    limit = outcome_of(tmp_path, 130, "SIGUSR1")
    assert limit.exit_code == contract.EXIT_INTERRUPTED and "time limit" in limit.error


def test_bad_input_keeps_its_exit_code_and_success_is_ok(tmp_path):
    node(tmp_path, 0, "node1", {"outcome": "failed", "failures": {"0": rank_failure(
        2, 1000, "user_error", "suffix=x: bad")}}, (1, 1000))
    outcome = outcome_of(tmp_path)
    assert (outcome.exit_code, outcome.error) == (contract.EXIT_USER_ERROR, "rank 0: suffix=x: bad")
    ok_dir = tmp_path / "ok"
    node(ok_dir, 0, "node1", {"outcome": "ok", "failures": {}}, (0, 1000))
    assert outcome_of(ok_dir, step_exit=0).exit_code == contract.EXIT_OK
    assert outcome_of(tmp_path / "none", step_exit=1).exit_code == contract.EXIT_FAILED


def test_the_ranks_error_files_are_read_where_the_agent_wrote_none(tmp_path):
    """A rank's own error before its node's agent died is the cause; one written after (its
    write cut short by the kill) is not."""
    node(tmp_path, 0, "node2", None, (137, 1000),
         error_file={"status": "failed", "error": "OSError: boom", "cause": "error"},
         error_time_s=999)
    (report,) = node_reports(tmp_path)
    assert report["error_files"] == {"0": {"status": "failed", "error": "OSError: boom",
                                           "cause": "error", "timestamp": 999}}
    assert outcome_of(tmp_path).error == "node2 (local rank 0): OSError: boom"
    later = tmp_path / "later"
    node(later, 0, "node2", None, (137, 1000),
         error_file={"status": "failed", "error": "RuntimeError: zip", "cause": "error"},
         error_time_s=1030)
    assert outcome_of(later).error == "node2: the node's torchrun agent was killed by SIGKILL"


def test_a_kill_replaces_the_error_a_rank_recorded_and_keeps_its_words(tmp_path):
    """The record a rank wrote with the zip error its cut-short write raised: the node's
    killed agent, seen after the step, is the cause; the rank's line stays beside it."""
    from dcp_fsdp.launch import aftermath
    from dcp_fsdp.launch.aftermath import RanksOutcome

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"record": "run", "status": "failed", "end_cause": "error",
                                "error": "rank 1: RuntimeError: [enforce fail at "
                                         "inline_container.cc:672]"}) + "\n")
    line = "node2: the node's torchrun agent was killed by SIGKILL"
    run, replaced = aftermath._amend(path, RanksOutcome(1, "failed", line,
                                                        cause=contract.EndCause.KILLED))
    assert replaced and run["end_cause"] == "killed"
    assert run["error"] == (f"{line}; the ranks recorded: rank 1: RuntimeError: [enforce fail "
                            "at inline_container.cc:672]")
    # a record that already names a kill keeps it
    again, replaced_again = aftermath._amend(path, RanksOutcome(
        1, "failed", "rank 0 was killed by SIGKILL", cause=contract.EndCause.KILLED))
    assert not replaced_again and again["error"].startswith(line)
