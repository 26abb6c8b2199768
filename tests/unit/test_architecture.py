"""The house rules the tree promises: no test equipment in the wheel, the top-level conf/
inside it, small modules, the layers (import-linter's contracts in pyproject.toml) and no
import cycles between the package's modules: every import counts, function-level and
TYPE_CHECKING ones included."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.kit.cli import REPO

PACKAGE = REPO / "dcp_fsdp"
MAX_RANK_MODULES = 12  # one rank's jobs; process life and death, tune's search live elsewhere


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names (in functions and
    under TYPE_CHECKING too: a cycle through a lazy import is still a cycle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_rank_holds_only_what_one_rank_runs():
    modules = [p.name for p in (PACKAGE / "rank").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_RANK_MODULES, sorted(modules)


def test_no_import_cycles():
    # import-linter's acyclic_siblings contract (pyproject.toml) holds siblings at every
    # depth; this also holds a package against its own modules (storage/__init__ -> fs ->
    # layout -> storage was one), which siblings alone do not see.
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules and m != name}
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


def test_the_cycle_check_sees_function_level_imports():
    """The graph above and import-linter's both hold imports made inside functions."""
    assert "dcp_fsdp.launch.local" in _imports(PACKAGE / "cli.py")  # only inside execute()
    import grimp

    graph = grimp.build_graph("dcp_fsdp")
    assert graph.direct_import_exists(importer="dcp_fsdp.cli", imported="dcp_fsdp.launch.local")


def _run_python(code: str, cwd: Path, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


COMPOSE_L7B = ("from dcp_fsdp.config.compose import CONF_DIR, compose; "
               "cfg = compose('save', ['model=L7b', 'storage=fs', 'storage.path=/x']); "
               "print(CONF_DIR, cfg.model.preset)")
