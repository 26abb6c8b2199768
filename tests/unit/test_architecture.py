"""The house rules the tree promises: no test equipment in the wheel, small modules,
and no import cycles between the package's modules (top-level imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.kit.cli import REPO

PACKAGE = REPO / "dcp_fsdp"
MAX_MODULE_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only: lazy imports are fine
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_module_is_oversized():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES} == {}


def test_no_import_cycles():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _top_level_imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_the_wheel_holds_only_what_users_run(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(REPO)], check=True,
                   capture_output=True)
    (wheel,) = tmp_path.glob("dcp_fsdp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "fault_proxy" in n or "seaweed_counters" in n
                or n.startswith("tests/")]
    assert "dcp_fsdp/config/conf/config.yaml" in names  # Hydra's defaults ship with it
    assert "dcp_fsdp/storage/base.py" in names
