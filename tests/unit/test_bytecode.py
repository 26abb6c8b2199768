"""`make setup` leaves every installed module a rank imports byte-compiled.

Where PYTHONDONTWRITEBYTECODE=1 (this project's machines set it) Python never writes a .pyc,
so a module installed without one is compiled again by every process that imports it: one
such setup (sympy and mpmath, which torch imports, left uncompiled) made every launch of the
suite about a third dearer in CPU, and nothing failed (docs/measurements/2026-11-27-ci-cost.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import sysconfig
from pathlib import Path

from dcp_fsdp import compat
from dcp_fsdp.launch import forked_rank

# What the launcher and an agent import beside the rank's modules.
LAUNCH_MODULES = ("hydra", "omegaconf", "boto3", "torch.distributed.run")


def _stale(source: Path) -> bool:
    """No .pyc beside `source` that Python would use as it is (a timestamp-checked one must
    name the source's mtime and size; a hash-checked one is Python's to check)."""
    try:
        header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[:16]
        stat = source.stat()
    except OSError:
        return True
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return True
    if int.from_bytes(header[4:8], "little") & 1:  # hash-based
        return False
    return (int.from_bytes(header[8:12], "little") != int(stat.st_mtime) & 0xFFFFFFFF
            or int.from_bytes(header[12:16], "little") != stat.st_size & 0xFFFFFFFF)


def test_every_installed_module_a_launch_imports_has_an_up_to_date_pyc():
    for name in (*compat.RANK_TORCH_MODULES, *forked_rank.RANK_MODULES, *LAUNCH_MODULES):
        importlib.import_module(name)
    site_packages = Path(sysconfig.get_path("platlib")).resolve()
    files = [getattr(module, "__file__", None) for module in list(sys.modules.values())]
    sources = {Path(file).resolve() for file in files if file and file.endswith(".py")}
    installed = [source for source in sources if source.is_relative_to(site_packages)]
    assert len(installed) > 500, f"only {len(installed)} modules from {site_packages}"
    stale = sorted(str(source.relative_to(site_packages)) for source in installed
                   if _stale(source))
    assert not stale, (
        f"{len(stale)} installed modules have no up-to-date .pyc (first: {stale[:5]}): each "
        f"process compiles them again; rebuild the venv (rm -r .venv; make setup)")
