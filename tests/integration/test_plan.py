"""`dcp-fsdp plan` against what real saves wrote: the same objects with the same bytes, and a
`.metadata` within 5 % (issue 23, item 7), at 1, 2, 4 and 8 ranks (fs: cheap on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_fsdp.config.schema import CheckpointState, Dtype
from dcp_fsdp.config.arguments import parse
from dcp_fsdp.plan.command import parse_request, plan_world
from dcp_fsdp.plan.state import state_template
from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def saved_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.name.endswith(".distcp")}


@pytest.mark.parametrize("nproc, thread_count, state", [
    (1, 1, "model_and_optimizer"),
    (2, 1, "model_and_optimizer"),
    (4, 2, "model_and_optimizer"),
    (8, 1, "model"),
])
def test_plan_matches_a_measured_save(tmp_path, nproc, thread_count, state):
    settings = ["model=tiny_llama", f"state={state}", "storage=fs",
                f"storage.path={tmp_path / 'ckpt'}", f"storage.thread_count={thread_count}"]
    result = run_cli(["save", *settings, f"nproc={nproc}", "suffix=s", "progress=false",
                      f"results_dir={tmp_path / 'results'}"], timeout_s=600)
    assert_ok(result)
    saved = tmp_path / "ckpt" / "s"

    request = parse_request(parse(["plan", *settings, f"--world-size={nproc}",
                                  f"--ranks-per-node={nproc}"]))
    _, plan = plan_world(request, nproc)

    assert {o.name: o.size_bytes for o in plan.objects} == saved_files(saved)
    actual_metadata = (saved / ".metadata").stat().st_size
    assert abs(plan.metadata_bytes - actual_metadata) <= 0.05 * actual_metadata

    run, samples = read_run(tmp_path / "results")
    assert run["world_size"] == nproc
    written = {s["rank"]: s["written_bytes"] for s in samples if s["op"] == "save"}
    assert dict(enumerate(plan.rank_bytes())) == written
    if nproc == 2:  # and the command as a user runs it, this measured record beside it
        assert_plan_command_projects_from_the_record(settings, tmp_path / "results")


def assert_plan_command_projects_from_the_record(settings: list[str], results: Path) -> None:
    result = run_cli(["plan", *settings, "--world-size=8", "--ranks-per-node=2",
                      f"--record={results}"], timeout_s=600)
    assert_ok(result)
    out = result.stdout
    assert ".metadata:" in out and "memory per rank:" in out and "global planning" in out
    table = out.split("nodes    ranks")[1].splitlines()[2:]
    assert [row.split()[:2] for row in table] == [["1", "2"], ["2", "4"], ["4", "8"]]




def test_planned_requests_match_an_s3_save(s3, s3_uri, tmp_path):
    """The multipart requests a 2-rank S3 save made are the plan's (the tool's own manifest
    PutObject and HEADs aside)."""
    settings = ["model=tiny_llama", "storage.part_size_mib=5"]
    assert_ok(run_cli(["save", *settings, *s3_args(s3, s3_uri), "nproc=2", "progress=false",
                       f"results_dir={tmp_path}"], env=s3_env(s3), timeout_s=600))
    _, samples = read_run(tmp_path)
    kinds = ("CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "CopyObject")
    measured = sum(s["requests"]["by_type"].get(kind, {}).get("count", 0)
                   for s in samples if s["op"] == "save" for kind in kinds)

    from dcp_fsdp.plan import requests as rq

    request = parse_request(parse(["plan", *settings, f"storage.uri={s3_uri}", "--world-size=2"]))
    _, plan = plan_world(request, 2)
    planned = rq.count_requests([o.size_bytes for o in plan.objects], plan.metadata_bytes, 2,
                                5 << 20)
    assert planned.save_put == measured


@pytest.mark.parametrize("nproc, tp, state", [
    (2, 2, "model"), (4, 2, "model"), (4, 4, "model"), (2, 1, "model_and_optimizer"),
])
def test_planned_gets_match_an_s3_load(s3, s3_uri, tmp_path, nproc, tp, state):
    """Issue 49 item 6: a load's GETs were planned as each data object once (6 / 8 / 10 at
    tp=2 on 2 and 4 ranks, tp=4 on 4): every TP rank also reads what TP leaves whole, and
    every rank AdamW's steps, from the object of the rank DCP's deduplication had write it.
    Each rank's GETs (the connector's dcp_optimized reader: its range groups, ranged GETs of
    a part) against what it measured, and the plan's total against the run's."""
    settings = ["model=tiny_llama", f"model.tp={tp}", f"state={state}"]
    assert_ok(run_cli(["save", *settings, *s3_args(s3, s3_uri), f"nproc={nproc}",
                       "progress=false", f"results_dir={tmp_path / 's'}"], env=s3_env(s3),
                      timeout_s=600))
    (suffix,) = read_run(tmp_path / "s")[0]["suffixes"]
    assert_ok(run_cli(["load", *settings, *s3_args(s3, s3_uri), f"nproc={nproc}",
                       f"suffix={suffix}", "progress=false", f"results_dir={tmp_path / 'l'}"],
                      env=s3_env(s3), timeout_s=600))
    _, samples = read_run(tmp_path / "l")
    measured = {s["rank"]: s["requests"]["by_type"]["GetObject"]["count"]
                for s in samples if s["op"] == "load"}

    from dcp_fsdp.plan import requests as rq
    from dcp_fsdp.plan.render import plan_requests

    request = parse_request(parse(["plan", *settings, f"storage.uri={s3_uri}",
                                   f"--world-size={nproc}", f"--ranks-per-node={nproc}"]))
    _, plan = plan_world(request, nproc)
    assert plan.load_reads is not None
    part, gap = 8 << 20, 32 << 20  # the defaults: storage.part_size_mib, max_gap_size_mib
    planned = {rank: rq.rank_read_gets(reads, part, gap) + rq.parts(plan.metadata_bytes, part)
               for rank, reads in enumerate(plan.load_reads)}
    assert planned == measured
    assert plan_requests(request, plan).load_get == sum(measured.values())


def test_a_world_from_a_subset_of_the_layers_is_the_full_build():
    """plan/sample.py against a full build: the same write items and total bytes, and a
    `.metadata` within 0.5 % (pickle's frame headers and integer widths are not additive)."""
    from dcp_fsdp.plan.build import build_global_plan
    from dcp_fsdp.plan.sample import can_sample, sampled_global_plan

    template = state_template("L660m", Dtype.bf16, CheckpointState.model_and_optimizer)
    assert can_sample(template)
    args = (template, 4, 1, 1, lambda rank: f"__{rank}_", "s3://bucket/checkpoints/a-suffix")
    full, sampled = build_global_plan(*args), sampled_global_plan(*args)
    assert sampled.sampled and not full.sampled
    assert sampled.items == full.items
    assert sum(sampled.rank_bytes()) == sum(full.rank_bytes())
    assert [o.name for o in sampled.objects] == [o.name for o in full.objects]
    assert abs(sampled.metadata_bytes - full.metadata_bytes) <= 0.005 * full.metadata_bytes


def test_plan_leaves_nothing_in_tmpdir(tmp_path):
    """Issue 49 item 11: each `plan` left an empty $TMPDIR/torchinductor_$USER (building the
    state's modules imports torch._dynamo, which makes torch's cache directory); its own
    directory now, removed at its end. A process of its own: in this one torch._dynamo may be
    imported already, and it makes the directory only once."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    result = run_cli(["plan", "--world-size=2"], env={"TMPDIR": str(tmpdir)})
    assert_ok(result)
    assert sorted(p.name for p in tmpdir.iterdir()) == []
