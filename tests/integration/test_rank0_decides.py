"""rank0_decides: whatever rank 0's decision raises, the other ranks hear of it at once
(they never wait in the broadcast for a rank 0 that has left it). Two real gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kit.cli import REPO, clean_env

COLLECTIVE_TIMEOUT_S = 120  # what a rank left waiting would sit through

RANK = """
import datetime, json, sys
import torch.distributed as dist
from dcp_fsdp.errors import BenchmarkFailure, UserError
from dcp_fsdp.rank.distributed import RankContext, rank0_decides

rank, init_file, decision, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=%d))
ctx = RankContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                  backend="gloo", device=None, node_count=1, hostnames=("h", "h"))

def decide():
    if decision == "crash":
        raise RuntimeError("the listing broke")
    if decision == "user":
        raise UserError("suffix=x: bad")
    return 42

try:
    result = ["ok", rank0_decides(ctx, decide)]
except (BenchmarkFailure, UserError) as error:
    result = [type(error).__name__, str(error)]
json.dump(result, open(out, "w"))
""" % COLLECTIVE_TIMEOUT_S


@pytest.mark.parametrize("decision, kind, text", [
    ("crash", "BenchmarkFailure", "rank 0: RuntimeError: the listing broke"),
    ("user", "UserError", "suffix=x: bad"),
])
def test_every_rank_gets_rank_0s_outcome(tmp_path, decision, kind, text):
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "init"),
                               decision, str(tmp_path / f"out{r}")], cwd=REPO,
                              env=clean_env({"OMP_NUM_THREADS": "1"})) for r in (0, 1)]
    for process in ranks:
        process.wait(timeout=COLLECTIVE_TIMEOUT_S / 2)  # a waiting rank would time out here
    for r in (0, 1):
        assert json.loads((tmp_path / f"out{r}").read_text()) == [kind, text]
