"""The .metadata screen against a real attack in a child interpreter, and a hostile .metadata
given to `dcp-fsdp load`. Moved from tests/unit/test_metadata_screen.py."""

from __future__ import annotations

import subprocess
import sys

from tests.kit.cli import run_cli
from tests.unit.test_metadata_screen import _getattr_chain, _hostile_checkpoint


def test_the_getattr_chain_is_a_real_attack_on_a_permissive_screen(tmp_path):
    """The crafted file does run code where getattr and torch stand-ins are admitted (the
    old screen): the test above refuses a working exploit, not a dud."""
    marker = tmp_path / "pwned"
    (tmp_path / "attack.pkl").write_bytes(_getattr_chain(marker))
    permissive = ("import pickle, sys\n"
                  "class Stand:\n    def __init__(self): pass\n"
                  "class Old(pickle.Unpickler):\n"
                  "    def find_class(self, module, name):\n"
                  "        if module.startswith('torch'): return Stand\n"
                  "        return super().find_class(module, name)\n"
                  "Old(open(sys.argv[1], 'rb')).load()\n")
    subprocess.run([sys.executable, "-c", permissive, str(tmp_path / "attack.pkl")],
                   check=True, capture_output=True)
    assert marker.exists()


def test_a_load_of_a_hostile_metadata_exits_in_one_line_before_any_rank(tmp_path):
    marker = tmp_path / "pwned"
    _hostile_checkpoint(tmp_path / "ckpt", marker)
    result = run_cli(["load", "storage=fs", f"storage.path={tmp_path / 'ckpt'}", "suffix=x",
                      f"results_dir={tmp_path / 'results'}"], timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "refused as" in line]
    assert len(lines) == 1 and "builtins.getattr(" in lines[0], result.stderr
    assert not marker.exists()
