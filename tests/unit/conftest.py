"""tests/unit is the logic alone, in the test's own process (`make test-unit`: at most a
minute on 2 cores): a test here that starts a process fails, naming why. A test that needs a
process, a server or root belongs in tests/integration."""

from __future__ import annotations

import os
import subprocess

import matplotlib.font_manager  # noqa: F401 - before any test: see below
import pytest

# matplotlib's first import on a machine builds its font cache by running `fc-list`, a
# process: on a fresh machine the first unit test that plots (test_report, test_scaling)
# failed here for that alone. Imported above, once, before the fixture refuses processes.

_WHY = ("tests/unit starts no process (make test-unit runs the logic in-process); a test that "
        "needs a process, a server or root belongs in tests/integration")


@pytest.fixture(autouse=True)
def _no_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(_WHY)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
