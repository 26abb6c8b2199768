"""The harness's own cost, in one process: the tool's timed save/load (CheckpointLoop._timed:
hooks, byte counting, watchdog, request-log window) against a bare dcp.save / dcp.load with
a plain writer/reader, alternated on the same state dict, server and client settings.

Process-level differences (imports, memory, what ran before) are the same for both, so
what remains is the harness in the timed path. Started by itself (embedded SeaweedFS):

  python -m benchmarks.harness_ab --model L660m --dtype bf16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_main(args) -> None:
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.rank.session import RankSession

    session = RankSession(compose("save-and-load", args.overrides), time.monotonic())
    session.start_telemetry()
    session.join()
    session.open_store()
    sharded, state_dict = session.build()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.rank.loop import CheckpointLoop

    loop = CheckpointLoop(session.cfg, session.ctx, session.store, sharded, state_dict,
                          request_log=session.request_log, say=session.say,
                          on_timeout=session.on_timeout)
    store = session.store
    times: dict[str, list[float]] = {"tool save": [], "bare save": [], "tool load": [],
                                     "bare load": []}

    def bare(op: str, suffix: str) -> float:
        storage_io = store.writer(suffix) if op == "save" else store.reader(suffix)
        store.warm_up(storage_io)
        dist.barrier()
        begin = time.monotonic()
        if op == "save":
            dcp.save(state_dict, storage_writer=storage_io)
        else:
            dcp.load(state_dict, storage_reader=storage_io)
        return time.monotonic() - begin

    token = os.environ["AB_TOKEN"]
    for round_number in range(args.rounds):
        order = ("tool", "bare") if round_number % 2 == 0 else ("bare", "tool")
        for op in ("save", "load"):
            for who in order:
                suffix = f"ab-{token}-{round_number}-{who}"
                if who == "tool":
                    times[f"tool {op}"].append(loop._timed(op, round_number, suffix).duration_s)
                else:
                    times[f"bare {op}"].append(bare(op, suffix))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    if session.ctx.is_coordinator:
        Path(os.environ["AB_OUT"]).write_text(json.dumps(gathered))
    dist.barrier()
    os._exit(0)


def main() -> int:
    if "RANK" in os.environ:
        parser = argparse.ArgumentParser()
        parser.add_argument("--rounds", type=int)
        parser.add_argument("overrides", nargs="*")
        rank_main(parser.parse_args())
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--request-stats", default="true")
    args = parser.parse_args()
    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    server = EmbeddedS3(bucket="harness-ab")
    endpoint = server.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ab.json"
            env = {**os.environ, **endpoint.client_env(), "PYTHONPATH": str(REPO),
                   "AB_OUT": str(out), "AB_TOKEN": os.urandom(3).hex(),
                   "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.nproc}", "-m", "benchmarks.harness_ab",
                            "--rounds", str(args.rounds), f"model={args.model}",
                            f"model.dtype={args.dtype}", f"storage.uri=s3://{endpoint.bucket}/ckpt",
                            f"storage.endpoint={endpoint.endpoint_url}",
                            f"request_stats={args.request_stats}"],
                           cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
            per_rank = json.loads(out.read_text())
    finally:
        server.stop()
    # per round: the slowest rank
    slowest = {key: [max(rank[key][i] for rank in per_rank) for i in range(args.rounds)]
               for key in per_rank[0]}
    print(f"{args.model} {args.dtype}, {args.nproc} ranks, request_stats={args.request_stats}, "
          f"{args.rounds} rounds (slowest rank, seconds)")
    for key, values in slowest.items():
        print(f"  {key}: " + " ".join(f"{v:.3f}" for v in values))
    for op in ("save", "load"):
        ratios = [t / b for t, b in zip(slowest[f"tool {op}"], slowest[f"bare {op}"])]
        print(f"  {op}: tool/bare per round {' '.join(f'{r:.4f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
