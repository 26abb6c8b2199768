"""What a fresh interpreter imports and allocates: the modules that promise not to import torch
or the connector, and the allocator after the tables. Each runs a child python (moved from
tests/unit)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.cli import REPO
from tests.unit.test_metadata_screen import DATA
from tests.unit.test_values import FAULTS_AFTER_TABLES


def test_importing_compat_imports_neither_torch_nor_the_connector():
    code = ("import sys, dcp_fsdp.compat as c; c.torch_version_problem(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 's3torchconnector', 's3torchconnectorclient')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"


def test_the_screen_imports_no_torch():
    code = ("import sys; from dcp_fsdp.storage import metadata_peek as m; "
            "m.read_facts(open(sys.argv[1], 'rb').read()); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", code, str(DATA / "torch215_adamw.metadata")],
                            capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_building_the_tables_leaves_the_allocator_as_a_fresh_process():
    """Freeing a large temporary raises glibc's dynamic mmap threshold for good; after that a
    4 MiB temporary is served from heap memory already faulted in, and every dcp.load of the
    tool skipped the page faults a training job's load pays (issue 19)."""
    result = subprocess.run([sys.executable, "-c", FAULTS_AFTER_TABLES], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    faults, pages = map(int, result.stdout.split())
    assert faults >= pages // 2, f"{faults} page faults for a fresh {pages}-page temporary"


def test_composing_a_config_in_a_fresh_process_with_the_installed_hydra_plugins():
    """Hydra's first compose (its public API) loads every installed `hydra_plugins` package,
    multi-storage-client's included: composing still works there, sweeps included, and
    Hydra's registry is left as Hydra made it (nothing of the tool's in it)."""
    code = ("from dcp_fsdp.config.compose import compose, expand_sweeps; "
            "from hydra.core.plugins import Plugins; "
            "jobs = expand_sweeps(['iterations=1,2', 'storage=fs', 'storage.path=/x']); "
            "print([compose('save', job).iterations for job in jobs]); "
            "print(type(Plugins.instance()) is Plugins)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, check=True)
    assert result.stdout.splitlines() == ["[1, 2]", "True"], result.stdout + result.stderr
