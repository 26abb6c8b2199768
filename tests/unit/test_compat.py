"""compat.py holds every private torch / s3torchconnector internal: an AST scan of the
package finds none elsewhere, and each internal fails with one line when it is missing."""

from __future__ import annotations

import ast
from concurrent.futures import Future
import pickle
import re

import pytest

from dcp_fsdp import compat
from tests.kit.cli import REPO

PACKAGE = REPO / "dcp_fsdp"
FOREIGN = ("torch", "s3torchconnector", "s3torchconnectorclient")
PRIVATE_PATH = re.compile(r"^(?:%s)(?:\.\w+)*\._[A-Za-z]\w*" % "|".join(FOREIGN))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in FOREIGN


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """x.a.b -> (x, ["a", "b"])."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return node, names[::-1]


def _own_private_names() -> set[str]:
    """Every _name the package defines itself (functions, classes, attributes, variables):
    reaching one of those is the package's own business."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {name for name in own if name.startswith("_")}


# Private names of the standard library the package may use: documented there.
STDLIB_PRIVATE = {"_exit", "_asdict", "_replace", "_fields", "_make", "_name_", "_value_",
                  "_missing_"}


def private_uses(source: str, own: set[str]) -> list[str]:
    """Private torch/connector names a module reaches: imports of private modules or names,
    attribute chains from a torch/connector name, dotted strings naming private modules, and
    private attributes the package does not define (a connector object's `_client`)."""
    found = []
    bound: set[str] = set()  # local names of foreign modules and objects
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name):
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and _foreign(node.module):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                path = f"{node.module}.{alias.name}"
                if any(_private(part) for part in path.split(".")):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if PRIVATE_PATH.match(node.value):
                found.append(f"line {node.lineno}: {node.value!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        root, names = _chain(node)
        if isinstance(root, ast.Name) and root.id in bound:
            found.append(f"line {node.lineno}: {root.id}.{'.'.join(names)}")
        elif (node.attr not in own and node.attr not in STDLIB_PRIVATE
              and not (isinstance(root, ast.Name) and root.id in ("self", "cls"))):
            found.append(f"line {node.lineno}: .{node.attr}")
    return sorted(set(found))


def test_no_module_but_compat_reaches_a_private_torch_or_connector_name():
    own = _own_private_names()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        uses = private_uses(path.read_text(), own)
        if uses:
            offenders[str(path.relative_to(REPO))] = uses
    assert offenders == {}, "put these behind a function in dcp_fsdp/compat.py"


def dcp_object_names(source: str) -> list[str]:
    """Where a module spells DCP's data object naming itself (`.distcp`, an f-string
    starting `__{`), outside docstrings and comments: compat.py holds it."""
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in prose and ".distcp" in node.value):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif (isinstance(node, ast.JoinedStr) and len(node.values) > 1
              and isinstance(node.values[0], ast.Constant) and node.values[0].value == "__"
              and isinstance(node.values[1], ast.FormattedValue)):
            found.append(f"line {node.lineno}: f'__{{...}}'")
    return found


def test_no_module_but_compat_spells_dcps_data_object_names():
    offenders = {str(path.relative_to(REPO)): uses for path in sorted(PACKAGE.rglob("*.py"))
                 if path != PACKAGE / "compat.py" and (uses := dcp_object_names(path.read_text()))}
    assert offenders == {}, "use compat.data_object_prefix / saving_rank / DATA_OBJECT_SUFFIX"
    assert dcp_object_names('x = f"__{rank}_"\ny = re.compile(r"__(\\d+)_\\d+\\.distcp")') == [
        "line 1: f'__{...}'", "line 2: '__(\\\\d+)_\\\\d+\\\\.distcp'"]


@pytest.mark.parametrize("source, expected", [
    ("from torch.distributed.checkpoint._nested_dict import flatten_state_dict",
     "from torch.distributed.checkpoint._nested_dict"),
    ("from torch.distributed.checkpoint.filesystem import _split_by_size_and_type",
     "import _split_by_size_and_type"),
    ("from torch.distributed.checkpoint import _async_process_executor as p",
     "import _async_process_executor"),
    ("import torch._utils", "import torch._utils"),
    ("import torch\nsize = torch._utils._element_size(dtype)", "torch._utils._element_size"),
    ("import torch.distributed as dist\ndist._world", "dist._world"),
    ("def f(storage_io):\n    storage_io.fs._client._client", "._client"),
    ("NAME = 's3torchconnectorclient._mountpoint_s3_client'", "_mountpoint_s3_client"),
    ("client = getattr(storage_io.fs, '_client', None)", "'_client'"),
])
def test_the_scan_finds_each_kind_of_private_use(source, expected):
    uses = private_uses(source, own=set())
    assert any(expected in use for use in uses), uses


def test_the_scan_passes_public_and_own_names():
    source = ("import os\nimport torch\nfrom torch.distributed.checkpoint import FileSystemWriter\n"
              "class A:\n    def __init__(self):\n        self._x = 1\n"
              "    def f(self, other):\n        return other._x + torch.float32.itemsize\n"
              "os._exit(0)\n")
    assert private_uses(source, own={"_x"}) == []


# -- each internal: there on the tested torch, one line when it is not --------------------

def test_the_internals_work_on_the_installed_torch():
    import torch

    flat, _ = compat.flatten_state_dict({"model": {"w": torch.ones(2)}, "step": 3})
    assert set(flat) == {"model.w", "step"}
    assert compat.split_by_size_and_type(1, ["a", "b"]) == [["a", "b"]]
    fake = compat.fake_tensor((10**13, 100), torch.float32)  # 4e15 bytes: nothing allocated
    assert fake.shape == (10**13, 100) and fake.dtype == torch.float32


def test_a_missing_internal_names_it_the_version_and_a_way_out(monkeypatch):
    import torch.distributed.checkpoint.filesystem as filesystem

    monkeypatch.delattr(filesystem, "_split_by_size_and_type")
    with pytest.raises(compat.MissingInternal) as error:
        compat.split_by_size_and_type(2, [])
    message = str(error.value)
    assert "torch.distributed.checkpoint.filesystem._split_by_size_and_type" in message
    assert f"torch {compat.installed_version('torch')}" in message
    assert "\n" not in message


def test_a_missing_daemon_internal_points_to_the_thread_checkpointer(monkeypatch):
    import torch.distributed.checkpoint._async_process_executor as executor

    monkeypatch.delattr(executor, "_ProcessGroupInitInfo")
    with pytest.raises(compat.MissingInternal, match="use async_save.checkpointer=thread"):
        compat.start_checkpoint_daemon(None, lambda info: info)


def test_warm_up_without_the_client_warns_once():
    compat._warned.discard("client")
    warned: list[str] = []
    for _ in range(2):
        assert compat.build_native_client(object(), warned.append) is False
    assert len(warned) == 1 and "client set-up (~1 s) is inside the first timed save" in warned[0]
    assert f"s3torchconnector {compat.installed_version('s3torchconnector')}" in warned[0]


def test_compat_imports_nothing_of_the_package():
    """A leaf over private APIs: what the package does around an internal is handed in."""
    imported = [node for node in ast.walk(ast.parse((PACKAGE / "compat.py").read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in imported if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in imported if isinstance(node, ast.ImportFrom)]
    assert [name for name in names if name.split(".")[0] == "dcp_fsdp"] == []
    assert all(node.level == 0 for node in imported if isinstance(node, ast.ImportFrom))


@pytest.mark.parametrize("version, refused", [("2.6.0", True), ("2.10.1+cu128", True),
                                              ("2.11.0", False), ("2.15.0+cu132", False),
                                              ("2.16.0", False)])
def test_torch_outside_the_tested_range_is_refused_or_warned(monkeypatch, capsys, version,
                                                             refused):
    from dcp_fsdp.errors import UserError
    from dcp_fsdp.launch import checks

    monkeypatch.setattr(compat, "installed_version",
                        lambda name: version if name == "torch" else "1.5.0")
    if refused:
        with pytest.raises(UserError, match=f"torch {re.escape(version)} is older than 2.11"):
            checks.check_torch()
        return
    checks.check_torch()
    newer = compat.release(version) > compat.TORCH_MAX_TESTED
    assert ("newer than 2.15" in capsys.readouterr().err) == newer


def test_the_stager_probe_answers_what_a_second_staging_does():
    """torch 2.11's DefaultStager stages once (pytorch/pytorch#183413); the probe says so
    there (make torch-smoke runs it) and says reusable where a second staging works."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_fsdp.rank.async_save import stager_reusable

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"tensor": torch.ones(2), "nested": {"step": 1}})
        second_works = True
    except KeyError:
        second_works = False
    finally:
        stager.close()
    assert stager_reusable() is second_works


def test_the_keyed_save_planner_is_torchs_own_class_keyed_per_layout_and_pickles():
    """A subclass, not an attribute set on torch's planner: one plan cache key per writer
    layout, and the process checkpointer's pickle rebuilds it in the daemon."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    assert compat.save_planner(False, "fs:default") is None
    planner = compat.save_planner(True, "s3:binary")
    assert isinstance(planner, DefaultSavePlanner)
    assert planner._cached_plans_key == "DefaultSavePlanner:s3:binary"
    assert compat.save_planner(True, "s3:hex")._cached_plans_key != planner._cached_plans_key
    restored = pickle.loads(pickle.dumps(planner))
    assert type(restored) is type(planner) and restored._enable_plan_caching
    assert restored._cached_plans_key == planner._cached_plans_key


def test_the_host_stager_stages_in_its_thread_without_a_stream():
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = compat.host_stager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                use_async_staging=True,
                                                use_non_blocking_copy=False))
    try:
        assert isinstance(stager, DefaultStager)
        assert stager._staging_executor is not None and stager._staging_stream is None
        staged = stager.stage({"tensor": torch.ones(2)})
        assert isinstance(staged, Future)  # staged in its thread
        assert torch.equal(staged.result()["tensor"], torch.ones(2))
    finally:
        stager.close()
    with pytest.raises(ValueError, match="need a device"):
        compat.host_stager(StagingOptions(use_pinned_memory=True, use_async_staging=True))


def private_assignments(source: str) -> list[str]:
    """Assignments to another object's private attribute (`planner._key = ...`,
    `setattr(stager, "_config", ...)`): extending torch or the connector by changing their
    objects from outside, where a subclass sets its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute) and _private(target.attr):
                root, _ = _chain(target)
                if not (isinstance(root, ast.Name) and root.id in ("self", "cls")
                        and target.value is root):
                    found.append(f"line {target.lineno}: .{target.attr} =")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) > 1):
            found.append(f"line {node.lineno}: setattr(...)")
    return found


# The one left, named: the process checkpointer's daemon, started before the first timed save
# and tied to its rank's life (compat.start_checkpoint_daemon). torch offers no public way to
# start it or to run code in it first; a subclass of its executor cannot be handed to
# dcp.async_save (2.11-2.15).
KNOWN_ASSIGNMENTS = {"dcp_fsdp/compat.py": ["._CHECKPOINT_PROCESS ="]}


def test_no_module_sets_attributes_on_objects_not_its_own():
    offenders = {str(path.relative_to(REPO)): [use.split(": ", 1)[1] for use in uses]
                 for path in sorted(PACKAGE.rglob("*.py"))
                 if (uses := private_assignments(path.read_text()))}
    assert offenders == KNOWN_ASSIGNMENTS, "subclass the torch or connector class instead"
    assert private_assignments("planner._key = 1\nself._own = 2\nself.fs._client = 3\n"
                               "setattr(stager, '_config', 4)") == [
        "line 1: ._key =", "line 3: ._client =", "line 4: setattr(...)"]


# Methods that change a mapping or a list in place: called on another module's state
# (`os.environ.update(...)`, `mod.__dict__.update(...)`), they write into it as an assignment does.
MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__",
            "append", "extend", "insert", "remove"}
# Calls whose result is the object they are given (or one of its members), not a new one:
# `vars(mod)["x"] = 1` writes into the module's own dict.
SAME_OBJECT_CALLS = {"vars", "getattr"}


def _state_root(node: ast.AST) -> ast.AST:
    """What an attribute, subscript or vars()/getattr() chain is rooted at (`vars(m)["x"].y`
    -> m); a call of anything else makes a new object, and is the root itself."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in SAME_OBJECT_CALLS and node.args):
            node = node.args[0]
        else:
            return node


def _imported_names(tree: ast.AST) -> set[str]:
    """The names a module binds by import, and the local names it binds to their state
    (`instances = getattr(Singleton, "_instances")`, `namespace = vars(tabulate)`): writing
    through either writes into the other module's state."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    aliases = [(target.id, node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)]
    grown = True
    while grown:  # an alias of an alias is one too
        before = len(names)
        names.update(name for name, value in aliases
                     if isinstance(root := _state_root(value), ast.Name) and root.id in names)
        grown = len(names) > before
    return names


def module_assignments(source: str) -> list[str]:
    """Writes into the state of an imported module or of an object it holds: attribute and
    subscript assignments and deletions rooted at an imported name, directly or through a
    local alias of it or vars()/getattr() (`tabulate.MIN_PADDING = 0`, `vars(m)["x"] = y`,
    `instances = getattr(Singleton, "_instances"); instances[k] = v`, `del os.environ["X"]`),
    and in-place mutator calls on such state (`os.environ.update(...)`,
    `m.__dict__.update(...)`): a change to another module's state, for the whole process,
    that no subclass scan sees."""
    tree = ast.parse(source)
    imported = _imported_names(tree)

    def foreign(target: ast.AST, bare: bool = False) -> bool:
        """Rooted at an imported name or an alias of its state; `bare`: the name itself
        counts (a mutator called on it), not only an attribute or item of it."""
        root = _state_root(target)
        return ((bare or target is not root) and isinstance(root, ast.Name)
                and root.id in imported)

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if foreign(target):
                found.append(f"line {target.lineno}: del {ast.unparse(target)}"
                             if isinstance(node, ast.Delete)
                             else f"line {target.lineno}: {ast.unparse(target)} =")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and foreign(node.func.value, bare=True)):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return sorted(found, key=lambda use: int(use.split(":")[0].split()[1]))


# The process's own state, each named: the environment it and its children read (torch's
# inductor cache, tune's plan, the launcher's and the embedded server's variables, a store's
# client settings, the request log's, nccl's, the raised allocator's), sys.argv of a forked
# rank's entry, and the unraisable hook (its one owner: process/signals.py).
# tune_trials' `summary` is a local dict that shares its name with an imported function.
KNOWN_MODULE_ASSIGNMENTS = {
    "dcp_fsdp/cli.py": ["os.environ['TORCHINDUCTOR_CACHE_DIR'] =", "os.environ.pop(...)"],
    "dcp_fsdp/launch/forked_rank.py": ["sys.argv ="],
    "dcp_fsdp/launch/tune.py": ["os.environ.update(...)", "os.environ[contract.TUNE_ENV] =",
                                "os.environ.pop(...)"],
    "dcp_fsdp/process/allocator.py": ["os.environ.update(...)"],
    "dcp_fsdp/process/environ.py": ["os.environ.update(...)", "os.environ.pop(...)",
                                    "os.environ[key] ="],
    "dcp_fsdp/process/signals.py": ["sys.unraisablehook ="],
    "dcp_fsdp/rank/distributed.py": ["os.environ.setdefault(...)"],
    "dcp_fsdp/rank/session.py": ["os.environ.update(...)", "os.environ.update(...)"],
    "dcp_fsdp/rank/tune_trials.py": ["summary['ceiling'] =", "os.environ.update(...)"],
}


def test_no_module_changes_another_module_s_state_unnamed():
    offenders = {str(path.relative_to(REPO)): [use.split(": ", 1)[1] for use in uses]
                 for path in sorted(PACKAGE.rglob("*.py"))
                 if (uses := module_assignments(path.read_text()))}
    assert offenders == KNOWN_MODULE_ASSIGNMENTS, "no process-wide patch of another module"
    planted = ("import tabulate\nimport torch as t\nfrom x import y\nlocal = {}\n"
               "tabulate.MIN_PADDING = 0\nt.__dict__['x'] = 1\ny.z += 2\nlocal['k'] = 3\n")
    assert module_assignments(planted) == [
        "line 5: tabulate.MIN_PADDING =", "line 6: t.__dict__['x'] =", "line 7: y.z ="]


@pytest.mark.parametrize("source, expected", [
    ("import tabulate\ntabulate.MIN_PADDING = 0", "tabulate.MIN_PADDING ="),
    ("import tabulate\ntabulate.__dict__['MIN_PADDING'] = 0", "tabulate.__dict__['MIN_PADDING'] ="),
    ("import tabulate\nvars(tabulate)['MIN_PADDING'] = 0", "vars(tabulate)['MIN_PADDING'] ="),
    ("import tabulate\nnamespace = vars(tabulate)\nnamespace['MIN_PADDING'] = 0",
     "namespace['MIN_PADDING'] ="),
    ("import tabulate\ntabulate.__dict__.update(MIN_PADDING=0)", "tabulate.__dict__.update(...)"),
    ("import sys\nsys.modules['tabulate'].MIN_PADDING = 0", "sys.modules['tabulate'].MIN_PADDING ="),
    ("import hydra.core.singleton\nhydra.core.singleton.Singleton._instances[k] = v",
     "hydra.core.singleton.Singleton._instances[k] ="),
    ("from hydra.core.singleton import Singleton\nSingleton._instances[k] = v",
     "Singleton._instances[k] ="),
    # compat.py's own form until issue 48: the registry fetched by getattr, then written
    ("from hydra.core.singleton import Singleton\n"
     "instances = getattr(Singleton, '_instances', None)\ninstances[k] = v", "instances[k] ="),
    ("from hydra.core.singleton import Singleton\nregistry = Singleton._instances\n"
     "same = registry\nsame.setdefault(k, v)", "same.setdefault(...)"),
    ("import os\nos.environ.update(extra)", "os.environ.update(...)"),
    ("import os\ndel os.environ['X']", "del os.environ['X']"),
    ("import tabulate\ndel tabulate.MIN_PADDING", "del tabulate.MIN_PADDING"),
])
def test_the_module_scan_finds_each_write_into_another_module_s_state(source, expected):
    assert [use.split(": ", 1)[1] for use in module_assignments(source)] == [expected]


def test_the_module_scan_passes_new_objects_and_own_state():
    """What a call returns is a new object (a tensor, a copy of the environment), and a
    module's own names and locals are its own."""
    source = ("import os\nimport torch\nx = torch.zeros(3)\nx[0] = 1\n"
              "env = dict(os.environ)\nenv['X'] = '1'\nenv.update(os.environ)\n"
              "local = {}\nlocal['k'] = 1\nlocal.update(k=2)\nclass A:\n"
              "    def f(self):\n        self.x = os.sep\n        self.x.pop()\n")
    assert module_assignments(source) == []
