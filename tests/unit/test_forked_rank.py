"""Ranks forked by the fork server (launch/forked_rank.py): only where the test suite asks, which
starts are forked, how torchrun's arguments are rewritten, how a forked rank ends and is known
by its siblings. The forked start itself runs in every integration test that launches ranks
(tests/conftest.py sets the switch; tests/kit/cli.rank_of finds them by name); the exec start
in tests/integration/test_rank_start.py."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import config_from_args, parse_args, run_script_path

from dcp_fsdp import contract
from dcp_fsdp.launch import forked_rank
from dcp_fsdp.process import lifeline, peers

AGENT_ARGS = ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]


@pytest.mark.parametrize("switch, forked", [(None, False), ("0", False), ("", False),
                                            ("1", True)])
def test_the_agent_forks_only_where_the_test_suite_asks(monkeypatch, switch, forked):
    """Measured runs exec their ranks as torchrun does: the agent rewrites torchrun's
    arguments for a fork only under the test suite's switch; the ranks then record how
    they started (lifeline.rank_start)."""
    import signal

    import torch.distributed.run as torchrun

    from dcp_fsdp.launch import agent

    started: list[Any] = []
    monkeypatch.setattr(torchrun, "run", started.append)  # the agent's torchrun, not started
    monkeypatch.setattr(forked_rank, "fork_instead", lambda args: started.append("fork"))
    monkeypatch.setattr(forked_rank, "quiet_agent_logs", lambda: None)
    monkeypatch.setattr(lifeline, "die_with_parent", lambda signum: None)
    monkeypatch.setattr(lifeline, "remove_multiprocessing_tempdir", lambda: None)  # pytest's own
    monkeypatch.delenv(contract.AGENT_SUMMARY_ENV, raising=False)
    if switch is None:
        monkeypatch.delenv(contract.FORK_RANKS_TEST_ONLY_ENV, raising=False)
    else:
        monkeypatch.setenv(contract.FORK_RANKS_TEST_ONLY_ENV, switch)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert agent.main([*AGENT_ARGS, "-m", "dcp_fsdp"]) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert ("fork" in started) is forked and len(started) == 1 + forked


def test_a_rank_records_how_it_started(monkeypatch):
    monkeypatch.setattr(lifeline, "_success_returns", False)
    assert lifeline.rank_start() == contract.RANK_START_EXEC == "exec"
    lifeline.return_on_success()  # what a forked rank does first (become_rank)
    assert lifeline.rank_start() == contract.RANK_START_FORK == "fork"


@pytest.mark.parametrize("argv, forked", [
    (["-m", "dcp_fsdp"], True),
    (["-m", "dcp_fsdp", "save", "model=tiny_llama"], True),
    (["-m", "dcp_fsdp.launch.agent"], False),  # only the package's own entry is known
    (["-m", "other_package"], False),
    (["script.py"], False),
    (["--no-python", "dcp_fsdp"], False),
    (["--run-path", "dcp_fsdp"], False),
])
def test_only_the_package_module_is_forked(argv, forked):
    assert forked_rank.forkable(parse_args([*AGENT_ARGS, *argv])) is forked


def test_fork_instead_is_torchruns_own_run_path_entry_with_the_fork_server(monkeypatch):
    """torchrun's config for the rewritten arguments: its function entry (run_script_path)
    started by Python's fork server, with this file as the script and the module and its
    arguments after it; the fork server imports what a rank imports (once), the agent nothing.
    Not fork: the agent runs threads (torch's store server), and a rank forked while one held
    a lock hung in its first store call."""
    preloaded: list[list[str]] = []
    tempdirs: list[str] = []
    monkeypatch.setattr(forked_rank.multiprocessing, "set_forkserver_preload", preloaded.append)
    monkeypatch.setattr(forked_rank.compat, "use_multiprocessing_tempdir", tempdirs.append)
    # a Slurm job's TMPDIR: the fork server's socket path would pass 107 bytes under it
    args = parse_args([*AGENT_ARGS, "-m", "dcp_fsdp", "save", "nproc=2"])
    with monkeypatch.context() as deep:
        deep.setattr(forked_rank.tempfile, "gettempdir", lambda: "/tmp/" + "d" * 75)
        forked_rank.fork_instead(args)
    (tempdir,) = tempdirs
    shutil.rmtree(tempdir)
    assert Path(tempdir).parent == Path("/tmp")
    assert Path(tempdir).name.startswith(f"dcp-fsdp-mp-p{os.getpid()}-")  # fork_server finds it
    assert len(f"{tempdir}/listener-12345678") <= 107
    config, entry, entry_args = config_from_args(args)
    assert entry is run_script_path and config.start_method == "forkserver"
    assert Path(entry_args[0]) == Path(forked_rank.__file__)
    assert entry_args[1:] == ["dcp_fsdp", "save", "nproc=2"]
    (modules,) = preloaded
    assert "dcp_fsdp.rank.session" in modules
    assert modules[0] == "dcp_fsdp.launch.fork_server"  # first: the collector off for the rest
    assert modules[1] == "torch" and modules[-1] == forked_rank.__name__


def test_a_forked_rank_freezes_what_the_fork_server_imported(monkeypatch):
    """The imports' objects out of the rank's collections (copy-on-write: a slower timed
    save), first thing in the child; multiprocessing's start method an exec'd rank's."""
    frozen: list[bool] = []
    monkeypatch.setattr(forked_rank.gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(forked_rank.gc, "enable", lambda: frozen.append(False))
    monkeypatch.setattr(forked_rank.lifeline, "die_with_parent", lambda signum: None)
    monkeypatch.setattr(forked_rank.lifeline, "name_process", lambda name: None)
    monkeypatch.setattr(forked_rank.lifeline, "return_on_success", lambda: None)
    monkeypatch.setattr(forked_rank.faulthandler, "disable", lambda: None)
    monkeypatch.setattr(forked_rank.signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(forked_rank.sys, "argv", ["forked_rank.py", "dcp_fsdp", "save"])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    methods: list[str | None] = []
    monkeypatch.setattr(forked_rank.multiprocessing, "set_start_method",
                        lambda method, force: methods.append(method))
    forked_rank.become_rank("dcp_fsdp", 3)
    assert frozen == [True, False]  # frozen, then collecting again
    assert forked_rank.sys.argv == ["dcp_fsdp", "save"]
    assert methods == [None]  # a fresh interpreter's default, not the fork server's


class _Child:
    """What peers reads of a psutil.Process: its name and environment."""

    def __init__(self, name: str, environ: dict[str, str]):
        self._name, self._environ = name, environ

    def name(self) -> str:
        return self._name

    def environ(self) -> dict[str, str]:
        return self._environ


@pytest.mark.parametrize("name, environ, local_rank", [
    ("dcp-fsdp-r13", {}, 1),  # forked: global rank 13 on the node whose first is 12
    ("python", {"TORCHELASTIC_RUN_ID": "run", "LOCAL_RANK": "3"}, 3),  # exec'd
    ("python", {"TORCHELASTIC_RUN_ID": "another", "LOCAL_RANK": "3"}, None),
    ("python", {}, None),  # the agent's other children
    ("dcp-fsdp-rX", {}, None),
])
def test_a_sibling_is_known_by_name_when_forked_and_by_environment_when_execd(name, environ,
                                                                              local_rank):
    child: Any = _Child(name, environ)
    assert peers.sibling_local_rank(child, "run", base=12) == local_rank


def test_a_forked_rank_returns_on_success_and_ends_with_its_code_otherwise(monkeypatch):
    """torch's agent waits for a forked rank's return value: success raises SystemExit(0)
    (torch's entry returns None for it), a failure still ends the process at once."""
    ended: list[int] = []

    def fake_exit(code: int) -> None:
        ended.append(code)
        raise RuntimeError("ended")

    monkeypatch.setattr(lifeline.os, "_exit", fake_exit)
    monkeypatch.setattr(lifeline, "remove_multiprocessing_tempdir", lambda: None)  # pytest's own
    monkeypatch.setattr(lifeline, "_success_returns", False)
    with pytest.raises(RuntimeError):
        lifeline.end_process(0)
    lifeline.return_on_success()
    with pytest.raises(SystemExit) as returned:
        lifeline.end_process(0)
    assert returned.value.code == 0
    with pytest.raises(RuntimeError):
        lifeline.end_process(contract.EXIT_FAILED)
    assert ended == [0, contract.EXIT_FAILED]


def test_name_process_sets_the_name_ps_and_siblings_read():
    """prctl names the calling thread (a rank calls it from its main thread, whose name is
    the process's): here a thread of the test, not the test process."""
    seen: list[str] = []

    def named() -> None:
        assert lifeline.name_process(contract.rank_process_name(12345))
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=named)
    thread.start()
    thread.join()
    assert seen == ["dcp-fsdp-r12345"]


def test_the_start_parent_is_the_parent_at_fork(monkeypatch):
    """peers compares the parent at a signal with the parent at the start: for a forked rank
    that is the agent, not the agent's own parent (the value when the agent imported it).
    Its fork hook (os.register_at_fork) reads it again; called here as the child would."""
    monkeypatch.setattr(peers, "_START_PARENT", 1)
    monkeypatch.setattr(peers.os, "getppid", lambda: 4321)
    peers._started()
    assert peers._START_PARENT == 4321


class _Live(_Child):
    def __init__(self, pid: int, name: str, environ: dict[str, str]):
        super().__init__(name, environ)
        self.pid = pid


@pytest.mark.parametrize("children, ended", [
    # every sibling runs, one not named yet (forked this moment): nobody ended first
    ([_Live(11, "dcp-fsdp-r4", {}), _Live(12, "pt_elastic", {}), _Live(13, "dcp-fsdp-r7", {})], []),
    # global rank 5 (local 1) has ended; 4 and 7 run, forked
    ([_Live(11, "dcp-fsdp-r4", {}), _Live(13, "dcp-fsdp-r7", {})], [5]),
    # exec'd siblings, known by their environment; local 3 has ended
    ([_Live(11, "python", {"TORCHELASTIC_RUN_ID": "run", "LOCAL_RANK": "0"}),
      _Live(12, "python", {"TORCHELASTIC_RUN_ID": "run", "LOCAL_RANK": "1"})], [7]),
])
def test_ended_local_peers_counts_then_names_the_siblings(monkeypatch, children, ended):
    """This rank is global 6, local 2 of 4 on its node (the node's first is global 4)."""
    for name, value in {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2", "RANK": "6",
                        "TORCHELASTIC_RUN_ID": "run"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(peers, "_START_PARENT", 4321)
    monkeypatch.setattr(peers.os, "getppid", lambda: 4321)
    monkeypatch.setattr(peers, "_live_children", lambda pid: children)
    assert peers.ended_local_peers() == ended


def test_a_host_with_cuda_devices_keeps_the_execd_start(monkeypatch):
    """On a CUDA host the ranks are exec'd, and the agent imports nothing for them: torch's
    own imports ask CUDA whether it is available, which makes every later fork's first CUDA
    call raise "Cannot re-initialize CUDA in forked subprocess" (every nccl launch on the
    lent H100 did, issue 32) although torch.cuda.is_initialized() stays False."""
    import torch

    preloaded: list[list[str]] = []
    monkeypatch.setattr(forked_rank.multiprocessing, "set_forkserver_preload", preloaded.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    args = parse_args([*AGENT_ARGS, "-m", "dcp_fsdp", "save", "nproc=1"])
    assert forked_rank.fork_instead(args) is False
    config, entry, entry_args = config_from_args(args)
    assert entry == sys.executable and config.start_method == "spawn"
    assert entry_args[:2] == ["-u", "-m"] and "dcp_fsdp" in entry_args
    assert preloaded == []


def test_an_endpoints_secret_stays_out_of_its_repr():
    from dcp_fsdp.launch.embedded_s3 import S3Endpoint

    endpoint = S3Endpoint("http://127.0.0.1:1", "bench", "KEYID", "the-secret-value")
    assert "the-secret-value" not in repr(endpoint) and "KEYID" in repr(endpoint)
