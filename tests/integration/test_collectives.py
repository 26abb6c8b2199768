"""The collectives a rank uses at scale, on three real gloo ranks: rank 0 alone receives
every rank's objects; the others get fixed-size answers (a sum, the first problem). And no
module of a rank hands every rank every other rank's objects (all_gather_object)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.kit.cli import REPO, clean_env

WORLD = 3
RANK = """
import datetime, json, os, sys
import torch.distributed as dist
from dcp_fsdp.rank.distributed import (first_problem, gather_to_keepers,
                                       sum_over_ranks,
                                       wall_clock_spread_s)

rank, init_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=%d,
                        timeout=datetime.timedelta(seconds=60))
result = {
    "gathered": gather_to_keepers({"rank": rank, "payload": "x" * (rank + 1)}, keepers=1),
    "kept": gather_to_keepers(rank),
    "sums": sum_over_ranks(rank, 10),
    "none": first_problem(None),
    "first": first_problem("disk full on " + str(rank) if rank >= 1 else None),
    "spread_s": wall_clock_spread_s(),
}
with open(out, "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's threads may abort an interpreter teardown (dcp_fsdp.process.lifeline.end_process)
""" % WORLD


def test_only_rank_0_receives_objects_and_the_rest_get_fixed_size_answers(tmp_path):
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "init"),
                               str(tmp_path / f"out{r}")], cwd=REPO,
                              env=clean_env({"OMP_NUM_THREADS": "1"})) for r in range(WORLD)]
    for process in ranks:
        assert process.wait(timeout=120) == 0
    results = [json.loads((tmp_path / f"out{r}").read_text()) for r in range(WORLD)]
    assert results[0]["gathered"] == [{"rank": r, "payload": "x" * (r + 1)} for r in range(WORLD)]
    assert all(results[r]["gathered"] is None for r in range(1, WORLD))
    # rank 1 keeps every rank's too (it writes the record if rank 0 dies); rank 2 keeps none
    assert results[0]["kept"] == results[1]["kept"] == list(range(WORLD)) and results[2]["kept"] is None
    for result in results:
        assert result["sums"] == [0 + 1 + 2, 10 * WORLD]
        assert result["none"] is None
        assert result["first"] == [1, "disk full on 1"]  # the lowest rank with a problem
        # one host, one clock: what is left is the barrier's exit jitter
        assert 0.0 <= result["spread_s"] < 0.25


def test_no_rank_module_gathers_every_object_to_every_rank():
    rank_code = Path(REPO, "dcp_fsdp", "rank")
    offenders = [str(path.relative_to(REPO)) for path in rank_code.rglob("*.py")
                 if "all_gather_object" in path.read_text() or "all_gather(" in path.read_text()]
    assert offenders == []


NODE_DROP = """
import datetime, json, os, sys
import torch
import torch.distributed as dist
from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.rank.distributed import RankContext, drop_cache_on_node
from dcp_fsdp.storage import pagecache
from dcp_fsdp.storage.fs import FsStore

rank, init_file, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=%d,
                        timeout=datetime.timedelta(seconds=60))
real_drop, dropped = pagecache.drop, []
def recording_drop(paths):  # the test's own spy: what this rank asked the kernel to drop
    paths = list(paths)
    dropped.extend(str(p) for p in paths)
    return real_drop(paths)
pagecache.drop = recording_drop
store = FsStore(StorageConfig(kind=StorageKind.fs, path=root))
ctx = RankContext(rank=rank, world_size=%d, local_rank=rank, local_world_size=%d, backend="gloo",
                  device=torch.device("cpu"), node_count=1, hostnames=())
policy = drop_cache_on_node(store, "ckpt", ctx)
with open(out, "w") as f:
    json.dump({"dropped": dropped, "policy": policy}, f)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
""" % (WORLD, WORLD, WORLD)


def test_one_node_drops_each_checkpoint_file_once(tmp_path):
    checkpoint = tmp_path / "store" / "ckpt"
    checkpoint.mkdir(parents=True)
    files = sorted(str(checkpoint / name) for name in
                   [".metadata", *(f"__{r}_{i}.distcp" for r in range(WORLD) for i in range(2))])
    for path in files:
        Path(path).write_bytes(b"x" * 8192)
    ranks = [subprocess.Popen([sys.executable, "-c", NODE_DROP, str(r), str(tmp_path / "init"),
                               str(tmp_path / "store"), str(tmp_path / f"out{r}")], cwd=REPO,
                              env=clean_env({"OMP_NUM_THREADS": "1"})) for r in range(WORLD)]
    for process in ranks:
        assert process.wait(timeout=120) == 0
    results = [json.loads((tmp_path / f"out{r}").read_text()) for r in range(WORLD)]
    dropped = [path for result in results for path in result["dropped"]]
    assert sorted(dropped) == files  # every file, each by exactly one rank of the node
    assert all(result["dropped"] for result in results)  # the work is shared out
    assert len({result["policy"] for result in results}) == 1  # one policy, agreed
