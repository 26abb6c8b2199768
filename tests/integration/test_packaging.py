"""The package as installed and linted: import-linter's layers, the wheel (what it carries, run
from elsewhere) and the editable install. Moved from tests/unit/test_architecture.py: each runs
a tool or a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.kit.cli import REPO
from tests.unit.test_architecture import COMPOSE_L7B, PACKAGE, _run_python


def test_the_layers_hold():
    """`lint-imports` with the contracts in pyproject.toml: a violation fails `make test`."""
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_wheel_holds_only_what_users_run_and_conf(tmp_path):
    """`pip wheel .` (and so `pip install .`) carries the top-level conf/ as dcp_fsdp/conf,
    every package of the tree, and no test equipment; installed, it composes from there."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(REPO)], check=True,
                   capture_output=True)
    (wheel,) = tmp_path.glob("dcp_fsdp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "fault_proxy" in n or "seaweed_counters" in n
                or n.startswith("tests/")]
    conf = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert {"conf/config.yaml", "conf/model/L7b.yaml", "conf/model/GPT-4B.yaml"} <= conf
    assert {f"dcp_fsdp/{name}" for name in conf} <= set(names)  # Hydra's configs ship with it
    sources = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")}
    assert sources <= set(names), "a package is missing from pyproject's packages list"
    # installed from the wheel (what `pip install .` does), run from elsewhere
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    conf_dir, preset = _run_python(COMPOSE_L7B, cwd=tmp_path, pythonpath=str(target)).split()
    assert (Path(conf_dir), preset) == (target / "dcp_fsdp" / "conf", "L7b")


def test_the_editable_install_composes_from_the_top_level_conf(tmp_path):
    """`pip install -e .` (this venv): configs come from the repository's conf/, in place."""
    assert not (PACKAGE / "conf").exists()  # one config directory in the tree: conf/
    conf_dir, preset = _run_python(COMPOSE_L7B, cwd=tmp_path).split()
    assert (Path(conf_dir), preset) == (REPO / "conf", "L7b")
