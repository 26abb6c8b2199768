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
