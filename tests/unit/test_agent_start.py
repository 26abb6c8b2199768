"""How the agent's interpreter is started (launch/agent.py PYTHON_FLAGS): the same flags by the
local launcher and by every Slurm node's task, and what they are for. The cost they remove
is measured by benchmarks/agent_start.py (a subprocess, not a unit test's job)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from dcp_fsdp.config.compose import compose
from dcp_fsdp.launch import agent, local

REPO = Path(__file__).resolve().parents[2]


def test_the_local_launcher_starts_the_agent_with_its_flags(tmp_path):
    cfg = compose("save", ["storage=fs", f"storage.path={tmp_path / 'c'}", "nproc=2"])
    command = local._agent_command(cfg, tmp_path)
    flags = list(agent.PYTHON_FLAGS)
    assert command[:len(flags) + 3] == [sys.executable, *flags, "-m", "dcp_fsdp.launch.agent"]


def test_every_slurm_node_starts_the_agent_with_the_same_flags():
    task = (REPO / "batch" / "node_task.sh").read_text()
    starts = [line for line in task.splitlines() if "-m dcp_fsdp.launch.agent" in line
              and not line.lstrip().startswith("#")]
    assert starts == [f'"$python" {" ".join(agent.PYTHON_FLAGS)} -m dcp_fsdp.launch.agent '
                      '--log-dir "$node_dir/torchelastic" "$@" &']


def test_the_flags_give_the_standard_librarys_modules_their_files():
    """What the flag is for: a frame of runpy (two under every `-m`) names a file that is
    an imported module's, which inspect finds in its cache instead of searching every
    module. This interpreter (pytest's) may run frozen or not; the flag's meaning is
    Python's: frozen_modules=off imports the standard library from its files."""
    assert agent.PYTHON_FLAGS == ("-X", "frozen_modules=off")
    runpy_file = inspect.getfile(__import__("runpy"))
    assert Path(runpy_file).is_file()
