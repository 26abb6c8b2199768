"""Replicated loads (model.replicas, HSDP): the settings refused before any rank starts, the
rank layout, each rank's share of the checkpoint bytes, and egress in the end-of-run table
and the report. The real loads are tests/integration/test_replicas.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp_fsdp.units import MIB
from dcp_fsdp.analysis import report
from dcp_fsdp.analysis.metrics import run_figures
from dcp_fsdp.analysis.run_summary import replicas_words
from dcp_fsdp.config.compose import compose
from dcp_fsdp.config.schema import ReplicaLoad
from dcp_fsdp.config.validate import check_replicas
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks
from dcp_fsdp.models.build import replica_of
from dcp_fsdp.rank.replicas import replica_share
from dcp_fsdp.telemetry.figures import egress_mib
from dcp_fsdp.telemetry.records import RunRecord, Settings
from tests.unit.test_report import run_line, sample_line


# -- settings ------------------------------------------------------------------------------

def test_replicas_default_to_one_and_compose():
    cfg = compose("save-and-load", [])
    assert cfg.model.replicas == 1 and cfg.model.replica_load == ReplicaLoad.every_replica
    cfg = compose("save-and-load", ["model.replicas=2", "model.replica_load=read_once",
                                    "nproc=4"])
    assert cfg.model.replicas == 2 and cfg.model.replica_load == ReplicaLoad.read_once
    checks.check_launch(cfg)  # 4 ranks form 2 replicas of 2


@pytest.mark.parametrize("overrides, message", [
    (["model.replicas=0"], "model.replicas=0: must be 1 or more"),
    (["model.replicas=-2"], "model.replicas=-2: must be 1 or more"),
    (["model.replicas=two"], "model.replicas"),
    (["model.replica_load=once"], "model.replica_load"),
    (["model.replica_load=read_once"], "model.replica_load=read_once"),
    (["model.replica_load=read_once", "model.replicas=1"], "add model.replicas=2"),
])
def test_bad_replica_settings_fail_with_one_line_naming_the_setting(overrides, message):
    with pytest.raises(UserError) as error:
        compose("save-and-load", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("replicas, world_size, fix", [
    (3, 4, "use nproc=6 (a multiple of 3), or model.replicas one of 1, 2, 4"),
    (2, 3, "use nproc=4 (a multiple of 2), or model.replicas one of 1, 3"),
    (8, 4, "use nproc=8 (a multiple of 8), or model.replicas one of 1, 2, 4"),
])
def test_a_world_size_that_is_not_a_multiple_of_replicas_is_refused(replicas, world_size, fix):
    with pytest.raises(UserError) as error:
        check_replicas(replicas, world_size, "nproc")
    text = str(error.value)
    assert text.startswith(f"model.replicas={replicas}: nproc={world_size} ranks cannot form")
    assert fix in text and "\n" not in text


def test_with_tp_every_fix_a_replicas_refusal_names_is_accepted():
    """Issue 49: 'model.replicas one of 1, 2, 4' with model.tp=2 on 4 ranks, where replicas=4
    is then refused by model.tp's check (4 x 2 ranks are not 4)."""
    from dcp_fsdp.models.presets import PRESETS
    from dcp_fsdp.models.tensor_parallel import check_tp

    with pytest.raises(UserError) as error:
        check_replicas(3, 4, "nproc", tp=2)
    text = str(error.value)
    assert "use nproc=6 (a multiple of 6 = 3 x model.tp=2), or model.replicas one of 1, 2" in text
    cfg = compose("save-and-load", ["model.replicas=3", "model.tp=2", "nproc=4"])
    with pytest.raises(UserError, match="or model.replicas one of 1, 2$"):
        checks.check_launch(cfg)
    check_tp(PRESETS["tiny_llama"], 2, 3, 6, "nproc")
    for replicas in (1, 2):
        check_tp(PRESETS["tiny_llama"], 2, replicas, 4, "nproc")


def test_a_torchrun_rank_names_only_replicas_that_fit_with_tp(monkeypatch, tmp_path):
    """Under torchrun the rank's own check counts model.tp as the launcher's does: with tp=2 on
    WORLD_SIZE=4, replicas=4 would be refused by model.tp's check in turn."""
    from dcp_fsdp.cli import check_torchrun_rank

    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DCP_FSDP_RUN_ID", raising=False)
    monkeypatch.delenv("DCP_FSDP_ARGV", raising=False)
    cfg = compose("save-and-load", ["model.replicas=3", "model.tp=2", f"results_dir={tmp_path}",
                                    "storage=fs", f"storage.path={tmp_path / 'ck'}"])
    with pytest.raises(UserError) as error:
        check_torchrun_rank(cfg)
    assert str(error.value).endswith("use WORLD_SIZE=6 (a multiple of 6 = 3 x model.tp=2), or "
                                     "model.replicas one of 1, 2"), error.value


def test_the_launcher_checks_nproc_against_replicas_before_anything_starts():
    cfg = compose("save-and-load", ["model.replicas=3", "nproc=4"])  # settings alone: fine
    with pytest.raises(UserError, match="model.replicas=3: nproc=4 ranks cannot form"):
        checks.check_launch(cfg)


def test_world_sizes_that_are_multiples_pass():
    for replicas, world_size in ((1, 1), (1, 3), (2, 4), (4, 4), (2, 8), (3, 6)):
        check_replicas(replicas, world_size, "WORLD_SIZE")


# -- layout and bytes ----------------------------------------------------------------------

def test_replica_0_is_the_first_ranks_row_major_like_init_device_mesh():
    assert [replica_of(r, 4, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [replica_of(r, 6, 3) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                        (2, 0), (2, 1)]
    assert [replica_of(r, 3, 1) for r in range(3)] == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("nbytes, replicas", [(14717440, 2), (10, 3), (7, 4), (1, 2), (0, 2),
                                              (29434880, 1)])
def test_replica_shares_sum_to_the_shard_exactly(nbytes, replicas):
    shares = [replica_share(nbytes, replicas, r) for r in range(replicas)]
    assert sum(shares) == nbytes
    assert max(shares) - min(shares) <= 1
    assert replica_share(nbytes, 1, 0) == nbytes  # no replicas: the shard's bytes


# -- egress in the tables ------------------------------------------------------------------

def _load(rank: int, fetched: int | None, nbytes: int = 7 * MIB, run_id: str = "r") -> dict:
    line = sample_line(run_id, "load", 1, rank, 0.0, 1.0, nbytes, with_phases=False,
                       count=2, latency_ms=5, kind="GetObject")
    line["fetched_bytes"] = fetched
    return line


def test_egress_is_the_sum_of_what_the_ranks_fetched_and_unknown_when_one_rank_is():
    import pandas as pd

    ops = pd.DataFrame({"fetched_bytes": [28 * MIB, 28 * MIB]})
    assert egress_mib(ops) == 56.0
    assert pd.isna(egress_mib(pd.DataFrame({"fetched_bytes": [28 * MIB, None]})))
    assert pd.isna(egress_mib(pd.DataFrame({"bytes": [1]})))


def test_the_end_of_run_table_shows_egress_for_loads_and_the_read_amplification():
    every_replica = [_load(rank, 14 * MIB) for rank in range(4)]  # 2 replicas x 28 MiB
    headers, rows, _ = run_figures(every_replica)
    cells = dict(zip(headers, rows[0]))
    assert headers[:5] == ["op", "iter", "suffix", "MiB", "egress MiB"]
    assert cells["MiB"] == "28.0" and cells["egress MiB"] == "56.0"
    assert cells["note"] == "reads 2.00x"
    read_once = [_load(rank, 14 * MIB if rank < 2 else 0) for rank in range(4)]
    headers, rows, _ = run_figures(read_once)
    cells = dict(zip(headers, rows[0]))
    assert cells["egress MiB"] == "28.0" and "note" not in headers
    saves = [sample_line("r", "save", 1, rank, 0.0, 1.0, 7 * MIB, count=3, latency_ms=9) for rank in range(4)]
    headers, _, _ = run_figures(saves)
    assert "egress MiB" not in headers  # a save fetches nothing: no empty column


def test_the_report_splits_loads_by_replica_load_and_shows_egress_per_operation(tmp_path):
    for run_id, mode, fetched in (("every", "every_replica", 14 * MIB), ("once", "read_once", 0)):
        config = {"model": {"preset": "tiny_llama", "dtype": "fp32", "replicas": 2,
                            "replica_load": mode}}
        lines = [run_line(run_id, ranks=4, command="save-and-load", extra_config=config)]
        lines += [sample_line(run_id, "save", 1, rank, 0.0, 1.0, 7 * MIB, count=3,
                              latency_ms=9) for rank in range(4)]
        lines += [_load(rank, 14 * MIB if rank < 2 else fetched, run_id=run_id)
                  for rank in range(4)]
        Path(tmp_path / f"{run_id}.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines))
    runs, samples, _ = report.read_records(report.record_files([str(tmp_path)]))
    table = report.build(runs, samples)["throughput"]
    loads = table[table["op"] == "load"].set_index("model.replica_load")
    assert loads.loc["every_replica", "egress_mib_per_op"] == 56.0
    assert loads.loc["read_once", "egress_mib_per_op"] == 28.0
    saves = table[table["op"] == "save"]
    assert len(saves) == 1  # replica_load changes loads only: one save row for both runs


def test_the_run_summary_names_the_replicas():
    run = RunRecord(run_id="r", command="save-and-load",
                    config=Settings.model_validate({"model": {"replicas": 2, "replica_load": "read_once"}}))
    assert replicas_words(run) == " as 2 replicas (loads: read_once)"
    run.command = "save"
    assert replicas_words(run) == " as 2 replicas"
    run.config = Settings.model_validate({"model": {"replicas": 1}})
    assert replicas_words(run) == ""
    run.config = Settings()  # a record from before model.replicas
    assert replicas_words(run) == ""
