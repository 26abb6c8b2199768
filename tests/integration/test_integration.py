"""End to end: real 2-rank gloo runs against a real SeaweedFS on loopback."""

from __future__ import annotations

import json
import os
import socket

import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env



def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def check_samples(run, samples, ops):
    assert run["status"] == "ok" and run["error"] is None
    assert run["world_size"] == 2 and run["node_count"] == 1 and run["backend"] == "gloo"
    for op, iterations in ops.items():
        rows = [s for s in samples if s["op"] == op]
        assert sorted({s["iteration"] for s in rows}) == list(range(1, iterations + 1))
        assert sorted({s["rank"] for s in rows}) == [0, 1]
        for s in rows:
            assert s["bytes"] > 0 and 0 < s["duration_s"] < 120
            assert s["begin_wall_s"] < s["end_wall_s"]
            assert abs((s["end_mono_s"] - s["begin_mono_s"]) - s["duration_s"]) < 1e-6
            assert s["plan_s"] >= 0 and s["io_s"] >= 0 and s["commit_s"] >= 0
            # the process's CPU in the region: some, never more than every core all the time
            assert 0 < s["cpu_s"] <= s["duration_s"] * len(os.sched_getaffinity(0)) + 0.01, s
    # Every figure is recomputable: the rank bytes add up to the whole checkpoint.
    per_iteration: dict[tuple[str, int], int] = {}
    for s in samples:
        per_iteration.setdefault((s["op"], s["iteration"]), 0)
        per_iteration[(s["op"], s["iteration"])] += s["bytes"]
    return per_iteration


def test_torchrun_save_then_load_by_suffix_in_another_invocation(s3, s3_uri, tmp_path):
    """S3 given only through standard AWS environment variables, like a real cluster."""
    env = {**s3_env(s3), "AWS_ENDPOINT_URL": s3.endpoint_url, "AWS_REGION": "us-east-1"}
    save = run_cli(["save", f"storage.uri={s3_uri}", "iterations=2",
                    f"results_dir={tmp_path / 'save'}"], env=env, torchrun_nproc=2)
    assert_ok(save)
    run, samples = read_run(tmp_path / "save")
    totals = check_samples(run, samples, {"save": 2})
    assert len(run["suffixes"]) == 2 and len(set(run["suffixes"])) == 2
    assert f"SUFFIXES={','.join(run['suffixes'])}" in save.stdout
    for suffix in run["suffixes"]:
        assert f"saved suffix={suffix}" in save.stdout
    # The record holds what the issue promises.
    assert run["model"]["preset"] == "tiny_llama"
    assert run["model"]["param_count"] > 1_000_000
    assert run["model"]["state_bytes"] == run["model"]["param_bytes"]
    assert run["storage"]["kind"] == "s3" and run["storage"]["embedded"] is False
    assert run["versions"]["torch"] and run["versions"]["s3torchconnector"]
    assert all("init_s" in row for row in run["init"]) and len(run["init"]) == 2
    assert run["hostnames"] and run["nproc_per_node"] == 2
    # Checkpoint bytes are the model's bytes; what was written adds a little DCP framing.
    for total in totals.values():
        assert total == run["model"]["state_bytes"]
    for iteration in (1, 2):
        written = sum(s["written_bytes"] for s in samples if s["iteration"] == iteration)
        assert run["model"]["state_bytes"] <= written < run["model"]["state_bytes"] * 1.01

    suffix = run["suffixes"][1]
    load = run_cli(["load", f"storage.uri={s3_uri}", f"suffix={suffix}", "nproc=2",
                    f"results_dir={tmp_path / 'load'}"], env=env)
    assert_ok(load)
    load_run, load_samples = read_run(tmp_path / "load")
    load_totals = check_samples(load_run, load_samples, {"load": 1})
    assert load_run["suffixes"] == [suffix]
    assert load_totals[("load", 1)] == totals[("save", 2)]


def test_save_and_load_model_and_optimizer_gpt2_bf16(s3, s3_uri, tmp_path):
    """AdamW state (~3x the weights), tied embeddings, bit-exact check after every load."""
    result = run_cli(["save-and-load", *s3_args(s3, s3_uri), "model=tiny_gpt2",
                      "model.dtype=bf16", "state=model_and_optimizer", "iterations=2",
                      "nproc=2", "delay_s=0.2", f"results_dir={tmp_path}"], env=s3_env(s3))
    assert_ok(result)
    run, samples = read_run(tmp_path)
    totals = check_samples(run, samples, {"save": 2, "load": 2})
    model = run["model"]
    assert model["dtype"] == "bf16" and model["state"] == "model_and_optimizer"
    assert model["state_bytes"] > 2.5 * model["param_bytes"]
    # AdamW's step scalars are on every rank and written once: counted once (issue 49 item 8)
    assert set(totals.values()) == {model["state_bytes"]}, totals
    assert "aggregate MiB/s" in result.stdout and "save (all)" in result.stdout
    # The delay sits between phases, outside the timers.
    for iteration in (1, 2):
        save = max(s["end_wall_s"] for s in samples if s["op"] == "save" and s["iteration"] == iteration)
        load = min(s["begin_wall_s"] for s in samples if s["op"] == "load" and s["iteration"] == iteration)
        assert load - save >= 0.2


def test_fs_backend_save_and_load(tmp_path):
    result = run_cli(["save-and-load", "storage=fs", f"storage.path={tmp_path / 'ckpt'}",
                      "nproc=2", f"results_dir={tmp_path / 'results'}"])
    assert_ok(result)
    run, samples = read_run(tmp_path / "results")
    check_samples(run, samples, {"save": 1, "load": 1})
    assert run["storage"]["kind"] == "fs"
    suffix = run["suffixes"][0]
    assert (tmp_path / "ckpt" / suffix / ".metadata").exists()
    listing = run_cli(["list", "storage=fs", f"storage.path={tmp_path / 'ckpt'}"])
    assert_ok(listing)
    assert suffix in listing.stdout and "complete" in listing.stdout


@pytest.fixture(scope="module")
def embedded_sweep(tmp_path_factory):
    """`save-and-load -m nproc=1,2` with no S3 settings at all: two jobs, each on an
    embedded server of its own. (the command's result, [(run, samples) of each record])"""
    root = tmp_path_factory.mktemp("embedded")
    result = run_cli(["save-and-load", "-m", "nproc=1,2", "model=tiny_llama",
                      f"results_dir={root}"])
    records = []
    for path in sorted(root.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        records.append((lines[0], lines[1:]))
    return result, records


def test_embedded_default_runs_with_nothing_configured(embedded_sweep):
    """What `make demo` does: no S3 settings at all (its 2-rank job of embedded_sweep)."""
    result, records = embedded_sweep
    assert_ok(result)
    (run, samples), = [(run, samples) for run, samples in records if run["world_size"] == 2]
    check_samples(run, samples, {"save": 1, "load": 1})
    assert run["storage"]["embedded"] is True
    assert run["storage"]["endpoint"].startswith("http://127.0.0.1:")
    assert "embedded SeaweedFS" in result.stdout
    # The server is gone afterwards: nothing answers on its port.
    port = int(run["storage"]["endpoint"].rsplit(":", 1)[1])
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_multirun_sweep_runs_each_job(s3, s3_uri, tmp_path):
    result = run_cli(["save", "-m", *s3_args(s3, s3_uri), "model=tiny_llama,tiny_gpt2",
                      f"results_dir={tmp_path}"], env=s3_env(s3))
    assert_ok(result)
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) == 2
    presets = set()
    for path in files:
        presets.add(json.loads(path.read_text().splitlines()[0])["model"]["preset"])
    assert presets == {"tiny_llama", "tiny_gpt2"}


def test_a_sweep_on_the_embedded_server_gives_each_job_its_own_keys(embedded_sweep):
    """Each job starts its own embedded server with fresh keys: nothing of job 1 (boto3's
    default session once kept the first keys it read) may sign job 2's requests (403)."""
    result, records = embedded_sweep
    assert_ok(result)
    assert "refused the credentials" not in result.stdout + result.stderr
    runs = [run for run, _ in records]
    assert sorted(run["world_size"] for run in runs) == [1, 2]
    assert [run["status"] for run in runs] == ["ok", "ok"]
    endpoints = {run["storage"]["endpoint"] for run in runs}
    assert len(endpoints) == 2 and all(run["storage"]["embedded"] for run in runs)
