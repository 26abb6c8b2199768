"""process/collector.py: the cyclic collector paused for a process's imports, and on again
(with what they made frozen) after them, an exception included."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import pytest

from dcp_fsdp.process.collector import paused_for_imports


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()  # this process's objects back into the generations the tests found them in
    if enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.fixture
def new_module(monkeypatch) -> Iterator[str]:
    """The name of a module that importing it inside a block adds to sys.modules."""
    name = "dcp_fsdp_test_collector_module"
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_paused_inside_on_after_with_what_the_imports_made_frozen(new_module):
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with paused_for_imports():
        assert not gc.isenabled()
        sys.modules[new_module] = types.ModuleType(new_module)  # what an import does
        made = [[index] for index in range(1000)]  # containers the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(made)


def test_a_block_that_imported_nothing_freezes_nothing():
    """plan_world's imports are done after its first call: later calls must not freeze
    the caller's objects (its garbage would never be collected)."""
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with paused_for_imports():
        made = [[index] for index in range(1000)]
    assert gc.get_freeze_count() == frozen_before, len(made)


def test_an_exception_inside_leaves_the_collector_on():
    gc.enable()
    with pytest.raises(KeyboardInterrupt), paused_for_imports():
        raise KeyboardInterrupt
    assert gc.isenabled()


def test_nested_blocks_keep_it_paused_until_the_outermost_ends():
    gc.enable()
    with paused_for_imports():
        with paused_for_imports():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    with paused_for_imports():
        pass
    assert not gc.isenabled()
