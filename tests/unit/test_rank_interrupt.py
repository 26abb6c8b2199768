"""A signal that reaches a launched rank before its guard can record it (while the session
is built, the guard installed) ends the rank with 130 and prints nothing: the launcher
prints the run's one `interrupted` line (issue 32 item 6: the line came twice under load)."""

from __future__ import annotations

import pytest

from dcp_fsdp import cli
from dcp_fsdp.contract import CONFIG_ENV, EXIT_INTERRUPTED
from dcp_fsdp.process import lifeline
from dcp_fsdp.process.signals import Terminated
from dcp_fsdp.rank import session


class _Ended(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.mark.parametrize("signal_error", [KeyboardInterrupt, Terminated])
def test_a_signal_before_the_guard_ends_the_rank_quietly(tmp_path, monkeypatch, capsys,
                                                         signal_error):
    config = tmp_path / "config.yaml"
    config.write_text("nproc: 2\nmodel:\n  preset: tiny_llama\n")
    monkeypatch.setenv(CONFIG_ENV, str(config))

    def run_rank(cfg, process_start_mono):
        raise signal_error()

    def end_process(code: int):
        raise _Ended(code)

    monkeypatch.setattr(session, "run_rank", run_rank)
    monkeypatch.setattr(lifeline, "end_process", end_process)
    with pytest.raises(_Ended) as ended:
        cli.launched_rank()
    assert ended.value.code == EXIT_INTERRUPTED
    out, err = capsys.readouterr()
    assert (out, err) == ("", "")


def _unraisable(exc: BaseException):
    import types

    return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                 err_msg="Exception ignored in", object=None)


def test_ctrl_c_lost_in_an_import_locks_callback_still_ends_the_command(capsys):
    """CI (2026-11-27): SIGINT during `report`'s imports landed in importlib's module-lock
    weakref callback; Python printed "Exception ignored in ... Traceback ... KeyboardInterrupt"
    and the command went on. The hook raises it again as a signal: the command's own Ctrl-C
    path (one line, 130) takes it, and nothing is printed."""
    import time

    from dcp_fsdp.process.signals import unraisable_hook

    with pytest.raises(KeyboardInterrupt):
        unraisable_hook(_unraisable(KeyboardInterrupt()))
        time.sleep(5)  # the signal's handler runs here, in the main thread
    assert capsys.readouterr().err == ""


def test_other_unraisable_errors_are_reported_as_python_does(monkeypatch, capsys):
    import gc
    import sys

    from dcp_fsdp.process.signals import unraisable_hook

    class Broken:
        def __del__(self) -> None:
            raise ValueError("in a __del__")

    caught: list = []
    monkeypatch.setattr(sys, "unraisablehook", caught.append)
    Broken()
    gc.collect()
    monkeypatch.undo()
    (unraisable,) = caught
    unraisable_hook(unraisable)
    assert "ValueError: in a __del__" in capsys.readouterr().err


def test_the_unraisable_hook_has_one_owner(monkeypatch, capsys):
    """Issue 48 item 4: cli.main and a rank's guard each replaced sys.unraisablehook (the guard
    wrapping whatever it found). Both now install process/signals.py's one hook, which drops a
    signal's exception once the guard has noted the signal."""
    import signal
    import sys

    from dcp_fsdp.process import signals

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    monkeypatch.setattr(signals, "_installed_guard", None)
    assert cli.main(["--version"]) == 0
    assert sys.unraisablehook is signals.unraisable_hook
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    guard = signals.InterruptGuard()
    try:
        guard.install()
        assert sys.unraisablehook is signals.unraisable_hook  # the same hook, not a wrapper
        guard.signal_name = "SIGTERM"
        signals.unraisable_hook(_unraisable(signals.Terminated()))  # noted: dropped, no SIGINT
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert capsys.readouterr().err == ""


def test_ctrl_c_inside_a_librarys_serializer_is_one_line_and_130(monkeypatch, capsys):
    """CI: Ctrl-C 0.6 of the way into `dcp-fsdp report` landed in a record model's serializer;
    pydantic raised PydanticSerializationError from the KeyboardInterrupt, and a traceback
    reached the terminal. An error whose cause is a KeyboardInterrupt ends as `interrupted`;
    any other error still propagates."""
    import signal

    from pydantic import BaseModel, model_serializer

    class Interrupted(BaseModel):
        @model_serializer(mode="wrap")
        def _written(self, handler):
            raise KeyboardInterrupt

    def dump(argv):
        return Interrupted().model_dump()

    monkeypatch.setattr(cli, "_command", dump)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["report"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.strip().splitlines() == ["dcp-fsdp: error: interrupted"]

    def broken(argv):
        raise ValueError("a bug")

    monkeypatch.setattr(cli, "_command", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["report"])
