"""Ranks as users run them (issue 47, item 4): a measured local run execs each rank, as
torchrun does, so that `ps` shows every rank as its own process with its own command line;
the forked start (launch/forked_rank.py) is the test suite's switch alone, and a forked and an
exec'd run of the same work give the same figures apart from time.

The rest of the suite forks its ranks (tests/conftest.py); these tests unset the switch. Timings
of the two starts are compared in benchmarks/fork_vs_exec.py, not here."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from dcp_fsdp.contract import FORK_RANKS_TEST_ONLY_ENV, RANK_PROCESS_NAME_PREFIX
from dcp_fsdp.storage.layout import CLAIM_NAME
from tests.kit.cli import read_run, s3_args, s3_client, s3_env, start_cli, stop

AGENT_MODULE = "dcp_fsdp.launch.agent"
NPROC = 2
# The measured work of the issue's `dcp-fsdp save-and-load nproc=2 iterations=3`, on the
# session's SeaweedFS (no server of its own to start); request statistics and integrity on.
WORK = ["save-and-load", f"nproc={NPROC}", "iterations=3", "progress=false"]


def _cmdline(process: psutil.Process) -> list[str] | None:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _watch_ranks(launcher: subprocess.Popen) -> tuple[list[str], dict[int, tuple[str, list[str]]]]:
    """While the run goes on: the agent's command line and, per child of the agent (its ranks),
    its name and command line as last seen. Stops once every rank shows a command line of its
    own, or when the run has ended (a forked rank never shows one)."""
    agent_cmdline: list[str] = []
    ranks: dict[int, tuple[str, list[str]]] = {}
    top = psutil.Process(launcher.pid)
    while launcher.poll() is None:
        try:
            below = top.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        agents = [p for p in below if AGENT_MODULE in (_cmdline(p) or [])]
        for agent in agents:
            agent_cmdline = _cmdline(agent) or agent_cmdline
            try:
                children = agent.children()
            except psutil.NoSuchProcess:
                continue
            for child in children:
                cmdline = _cmdline(child)
                try:
                    name = child.name()
                except psutil.Error:
                    continue
                if cmdline is not None:
                    ranks[child.pid] = (name, cmdline)
        own = [pid for pid, (_, cmdline) in ranks.items() if cmdline != agent_cmdline]
        if len(own) >= NPROC:
            break
        time.sleep(0.05)
    return agent_cmdline, ranks


def _run(s3, uri: str, results_dir: Path, fork: bool, watch: bool = False) -> dict:
    env = s3_env(s3)
    if fork:
        env[FORK_RANKS_TEST_ONLY_ENV] = "1"
    process = start_cli([*WORK, *s3_args(s3, uri), f"results_dir={results_dir}"], env,
                        unset=() if fork else (FORK_RANKS_TEST_ONLY_ENV,))
    watched = None
    try:
        if watch:
            watched = _watch_ranks(process)
        output, _ = process.communicate(timeout=300)
    except BaseException:
        stop(process)
        raise
    assert process.returncode == 0, output
    run, samples = read_run(results_dir)
    return {"run": run, "samples": samples, "watched": watched}


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """The same work twice into one prefix: exec'd ranks (watched with psutil), then forked."""
    s3 = s3_server.endpoint
    uri = f"s3://{s3.bucket}/rank-start-{time.time_ns()}"
    base = tmp_path_factory.mktemp("rank-start")
    execd = _run(s3, uri, base / "exec", fork=False, watch=True)
    forked = _run(s3, uri, base / "fork", fork=True)
    return {"exec": execd, "fork": forked, "s3": s3, "uri": uri}


def test_a_measured_run_execs_each_rank_with_its_own_command_line(runs):
    """`ps` during `dcp-fsdp save-and-load nproc=2 iterations=3` without the test switch:
    each rank a child of the agent with the command line torchrun gives an exec'd rank
    (`python -u -m dcp_fsdp`), not the agent's (what a forked rank shows), and not named
    as a forked rank; the record says `rank_start: exec`."""
    agent_cmdline, ranks = runs["exec"]["watched"]
    assert agent_cmdline and AGENT_MODULE in agent_cmdline, agent_cmdline
    own = {pid: seen for pid, seen in ranks.items() if seen[1] != agent_cmdline}
    assert len(own) == NPROC, (agent_cmdline, ranks)
    for name, cmdline in own.values():
        assert cmdline[1:] == ["-u", "-m", "dcp_fsdp"], cmdline
        assert not name.startswith(RANK_PROCESS_NAME_PREFIX), name
    assert runs["exec"]["run"]["rank_start"] == "exec"
    assert runs["fork"]["run"]["rank_start"] == "fork"


def _figures(result: dict) -> dict:
    """Everything of a run's samples that is not a time: per (op, iteration, rank) the bytes,
    the bytes fetched or written, and the S3 requests by type (count, failures, bytes)."""
    figures = {}
    for sample in result["samples"]:
        requests = sample.get("requests") or {}
        by_type = {kind: {key: entry.get(key) for key in ("count", "failed", "bytes_down",
                                                          "bytes_up")}
                   for kind, entry in (requests.get("by_type") or {}).items()}
        figures[(sample["op"], sample["iteration"], sample["rank"])] = {
            "bytes": sample["bytes"], "fetched_bytes": sample.get("fetched_bytes"),
            "written_bytes": sample.get("written_bytes"),
            "requests": {key: requests.get(key) for key in ("count", "failed", "retries",
                                                            "bytes_down", "bytes_up")},
            "by_type": by_type}
    return figures


def _objects(s3, uri: str, suffixes: list[str]) -> list[list[tuple[str, int | None]]]:
    """Per suffix, in order: every object's key below the suffix and its size. The claim's size
    is left out: it holds the claiming process's pid, whose digits vary run to run."""
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    client = s3_client(s3)
    listed = []
    for suffix in suffixes:
        found = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{suffix}/")
        names_and_sizes = ((obj["Key"].split(f"/{suffix}/", 1)[1], obj["Size"])
                           for obj in found.get("Contents", []))
        listed.append(sorted((name, None if name == CLAIM_NAME else size)
                             for name, size in names_and_sizes))
    return listed


def test_a_forked_and_an_execd_run_give_the_same_figures_apart_from_time(runs):
    execd, forked = runs["exec"], runs["fork"]
    assert (execd["run"]["rank_start"], forked["run"]["rank_start"]) == ("exec", "fork")
    assert _figures(execd) and _figures(execd) == _figures(forked)
    assert any(f["by_type"] for f in _figures(execd).values())  # request statistics were on
    s3, uri = runs["s3"], runs["uri"]
    exec_objects = _objects(s3, uri, execd["run"]["suffixes"])
    assert len(exec_objects) == 3 and all(exec_objects)
    assert exec_objects == _objects(s3, uri, forked["run"]["suffixes"])
    assert execd["run"]["world_size"] == forked["run"]["world_size"] == NPROC
