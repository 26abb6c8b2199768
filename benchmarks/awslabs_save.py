"""Our save against the awslabs DCP/FSDP save benchmark, side by side on the embedded SeaweedFS.

The awslabs benchmark is s3torchbenchmarking's dcp_fsdp save (awslabs/s3-connector-for-pytorch,
s3torchbenchmarking/src/s3torchbenchmarking/dcp_fsdp/save_benchmark.py and dcp_common.py).
Its method is reproduced here as a rank script (`--rank`), line for line where it matters:
  - the model: transformers' `AutoModelForCausalLM.from_config` of a `LlamaConfig` built as its
    `llama_model_config.get_llama_model_config` builds one, with our L660m shape (awslabs has no
    L660m; the same tensors as `dcp-fsdp`'s model=L660m, other values); rank 0 builds it on CPU,
    the others on `meta` with `param_init_fn=to_empty`;
  - FSDP1 (`FullyShardedDataParallel`, `transformer_auto_wrap_policy` over `LlamaDecoderLayer`,
    `use_orig_params=False`, FULL_SHARD, `sync_module_states=False` on gloo), its state dict as
    `{"model": model.state_dict()}` under `StateDictType.SHARDED_STATE_DICT` (ShardedTensors);
  - the writer: `S3StorageWriter(region, uri, thread_count=N)` built after the state dict and
    before the barrier, no `s3client_config` (the connector's defaults: 8 MiB parts, 10 Gbit/s,
    10 attempts, no forced path style), default prefix strategy; its native client is built
    lazily, by the first request inside `dcp.save`, as there;
  - the clock: `dist.barrier()`, `perf_counter()`, `dcp.save(state_dict, storage_writer=...)`
    (no planner, no process group, no checkpoint_id), `perf_counter()`;
  - its figure, per rank: the whole model's MiB (parameters + buffers, before FSDP) / the rank's
    own seconds (`process_timestamps`: one `throughput_mibs` per rank and epoch); here the mean
    over the ranks of one launch. One launch is one of its epochs (it spawns fresh processes per
    epoch too); under torchrun rather than `mp.spawn`.
After its figure, each rank also times the construction of one more native client
(`client_build_s`), the cost the awslabs figure carries and ours does not (our ranks build it
before the barrier: storage/s3_clients.py `warm_up`).

The other variant is `dcp-fsdp save model=L660m model.dtype=fp32 nproc=2 iterations=1` with
`storage.thread_count=N`, everything else as a user runs it (its defaults equal the awslabs
writer's: 8 MiB parts, 10 Gbit/s, 10 attempts, default prefixes, DCP's default planner).

Every round runs both once, in an order that alternates AB, BA, BA, AB (harness_cost's), each
on a checkpoint prefix of its own, after one untimed write that makes the server grow its
volumes. Per round three paired ratios, ours / awslabs (below 1: our save slower), with their
geometric mean and 95 % CI (benchmarks/paired.py):
  headline     each tool's own figure: ours the end-of-run table's aggregate MiB/s (all ranks'
               checkpoint bytes / the span, first begin to last end), awslabs' the mean of its
               per-rank MiB/s
  rank-mean    ours computed the awslabs way (all ranks' bytes / each rank's own seconds,
               mean over ranks): the same definition on both sides
  slowest      awslabs' slowest rank's seconds / ours: the work alone, no definition (the
               bytes are equal to 256 bytes: awslabs counts the rotary inv_freq buffer)

  python -m benchmarks.awslabs_save --pairs 10 --threads 8
  python -m benchmarks.awslabs_save --pairs 10 --threads 1
  python -m benchmarks.awslabs_save --pairs 10 --threads 8 --awslabs-fsdp 2   (the one switch)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.harness_cost import _delete_prefix, _env
from benchmarks.paired import PairedRatio, finally_on_sigterm, load_average, vacuum

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
VARIANTS = ("awslabs", "tool")
RATIOS = ("headline", "rank-mean", "slowest")


# -- the awslabs rank (under torchrun) ------------------------------------------------------

def llama_config(model: str) -> Any:
    """awslabs' get_llama_model_config, with the shape of our preset `model`."""
    from transformers import LlamaConfig

    from dcp_fsdp.models.llama_model_config import LLAMA_SHAPES

    shape = LLAMA_SHAPES[model]
    return LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size,
                       num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                       num_key_value_heads=shape.num_kv_heads,
                       max_position_embeddings=shape.max_positions, rms_norm_eps=shape.rms_norm_eps,
                       use_cache=False, pretraining_tp=1, tie_word_embeddings=False,
                       rope_scaling=None)


def model_mib(model: Any) -> float:
    """awslabs' BenchmarkModel.size: parameters and buffers, MiB."""
    params = sum(p.nelement() * p.element_size() for p in model.parameters())
    buffers = sum(b.nelement() * b.element_size() for b in model.buffers())
    return (params + buffers) / MIB


def client_build_s(writer: Any) -> float:
    """Seconds to build one more native client as the writer's was built (its first request)."""
    native = writer.fs._client  # noqa: SLF001 - the connector's S3Client wrapper
    begin = time.perf_counter()
    native._client_builder()  # noqa: SLF001
    return time.perf_counter() - begin


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fsdp1_state(model_name: str, rank: int) -> tuple[dict[str, Any], float]:
    """awslabs' model and state dict (save_benchmark.py): FSDP1, SHARDED_STATE_DICT; (state, MiB)."""
    import functools

    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = llama_config(model_name)
    if rank == 0:
        model = AutoModelForCausalLM.from_config(config)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    size_mib = model_mib(model)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    torch.cpu.set_device(rank % torch.cpu.device_count())
    # as awslabs passes them on gloo: the str "cpu" and a lambda returning the module
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.cpu.current_device(),  # type: ignore[arg-type]
                 use_orig_params=False, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 sync_module_states=False,
                 param_init_fn=(lambda module: module.to_empty(device=torch.device("cpu"), recurse=False))
                 if rank != 0 else None)  # type: ignore[arg-type]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict()}, size_mib


def fsdp2_state(model_name: str) -> tuple[dict[str, Any], float]:
    """The same model under FSDP2 (`fully_shard` over each decoder layer, then the root;
    `get_model_state_dict`: DTensors), as dcp-fsdp and torchtitan shard: the one switch
    `--awslabs-fsdp 2` makes. Every rank builds it on CPU (FSDP2 takes no rank-0-only init)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = AutoModelForCausalLM.from_config(llama_config(model_name))
    size_mib = model_mib(model)
    for module in model.modules():
        if isinstance(module, LlamaDecoderLayer):
            fully_shard(module)
    fully_shard(model)
    return {"model": get_model_state_dict(model)}, size_mib


def rank_main(model_name: str, uri: str, out: str, thread_count: int, fsdp: int = 1) -> int:
    """awslabs' run_fsdp_save for one epoch (save_benchmark.py), its figures to `out`."""
    from time import perf_counter

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state_dict, size_mib = fsdp1_state(model_name, rank) if fsdp == 1 else fsdp2_state(model_name)
    writer = S3StorageWriter(os.environ.get("AWS_REGION", "us-east-1"), uri, thread_count=thread_count)
    faults_before = minor_faults()  # not in awslabs: read outside its clock, as bare_dcp.py does
    dist.barrier()
    begin_save = perf_counter()
    dcp.save(state_dict, storage_writer=writer)
    end_save = perf_counter()
    faults = minor_faults() - faults_before
    saved_bytes = sum(value.to_local().nbytes if hasattr(value, "to_local")
                      else sum(shard.tensor.nbytes for shard in value.local_shards())
                      for value in state_dict["model"].values())
    figures = {"rank": rank, "begin": begin_save, "end": end_save, "size_mib": size_mib,
               "client_build_s": client_build_s(writer),
               "fresh_pages_per_byte": faults * 4096 / saved_bytes}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as bare_dcp.py and the tool's ranks: skip the native teardown (CRT threads)


# -- the two launches -------------------------------------------------------------------------

def run_awslabs(args: argparse.Namespace, uri: str, env: dict[str, str], log: IO[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "awslabs.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc}", f"--log-dir={Path(tmp) / 'torchelastic'}",
                   "-m", "benchmarks.awslabs_save", "--rank", args.model, uri, str(out), str(args.threads),
                   str(args.awslabs_fsdp)]
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        subprocess.run(command, cwd=REPO, env={"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"), **env},
                       stdout=log, stderr=log, check=True)
        ranks = json.loads(out.read_text())
    seconds = [r["end"] - r["begin"] for r in ranks]
    per_rank = [r["size_mib"] / s for r, s in zip(ranks, seconds)]
    return {"headline": statistics.fmean(per_rank), "rank-mean": statistics.fmean(per_rank),
            "slowest_s": max(seconds), "seconds": seconds, "mib": ranks[0]["size_mib"],
            "client_build_s": [r["client_build_s"] for r in ranks],
            "fresh_pages_per_byte": [r["fresh_pages_per_byte"] for r in ranks]}


def run_tool(args: argparse.Namespace, uri: str, endpoint: str, env: dict[str, str],
             log: IO[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "dcp_fsdp", "save", f"model={args.model}", "model.dtype=fp32",
                   f"nproc={args.nproc}", "iterations=1", f"storage.uri={uri}",
                   f"storage.endpoint={endpoint}", f"storage.thread_count={args.threads}",
                   f"results_dir={results}", *args.tool_setting]
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=log, check=True)
        (record,) = Path(results).glob("*.jsonl")
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    samples = [s for s in lines[1:] if s["record"] == "sample" and s["op"] == "save"]
    mib = sum(s["bytes"] for s in samples) / MIB
    span_s = max(s["end_mono_s"] for s in samples) - min(s["begin_mono_s"] for s in samples)
    seconds = [s["duration_s"] for s in samples]
    return {"headline": mib / span_s, "rank-mean": statistics.fmean(mib / s for s in seconds),
            "slowest_s": max(seconds), "seconds": seconds, "mib": mib,
            "fresh_pages_per_byte": [s["minor_faults"] * 4096 / s["bytes"] for s in samples
                                     if s.get("minor_faults") is not None]}


def ratios(figures: dict[str, list[dict[str, Any]]]) -> dict[str, PairedRatio]:
    """Ours / awslabs of each round, per definition (below 1: our save slower)."""
    tool, awslabs = figures["tool"], figures["awslabs"]
    paired = {name: PairedRatio.of([t[name] for t in tool], [a[name] for a in awslabs])
              for name in ("headline", "rank-mean")}
    paired["slowest"] = PairedRatio.of([a["slowest_s"] for a in awslabs], [t["slowest_s"] for t in tool])
    return paired


def summary(figures: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [f"{'ratio ours/awslabs':<19} {'n':>3} {'geo-mean':>9} {'95 % CI':>17} {'min..max':>13}"]
    for name, paired in ratios(figures).items():
        spread = f"{min(paired.ratios):.3f}..{max(paired.ratios):.3f}"
        lines.append(f"{name:<19} {len(paired.ratios):>3} {paired.cells(9)} {spread:>13}")
    for variant in VARIANTS:
        rows = figures[variant]
        lines.append(f"{variant}: median slowest-rank s {statistics.median(r['slowest_s'] for r in rows):.3f}, "
                     f"median headline MiB/s {statistics.median(r['headline'] for r in rows):.1f}, "
                     f"MiB {rows[0]['mib']:.3f}, fresh pages per byte (minor faults x 4 KiB / the "
                     f"rank's bytes, median over ranks and rounds) "
                     f"{statistics.median(f for r in rows for f in r['fresh_pages_per_byte']):.3f}")
    builds = [s for r in figures["awslabs"] for s in r["client_build_s"]]
    lines.append(f"awslabs: native client build inside its timer, median {statistics.median(builds):.4f} s "
                 "(measured after its save)")
    return lines


def round_orders(pairs: int) -> list[list[str]]:
    """AB, BA, BA, AB, ... (no variant always first)."""
    orders = []
    for number in range(pairs):
        order = list(VARIANTS) if number % 2 == 0 else list(reversed(VARIANTS))
        if (number // 2) % 2:
            order.reverse()
        orders.append(order)
    return orders


def warm_server(client: Any, bucket: str) -> None:
    """One multipart-sized object written and deleted before the first round: SeaweedFS grows
    a new bucket's volumes on its first writes, which would land in the first launch's timer."""
    client.put_object(Bucket=bucket, Key="warm-up", Body=os.urandom(16 * MIB))
    client.delete_object(Bucket=bucket, Key="warm-up")


def run_rounds(args: argparse.Namespace, log: IO[str]) -> dict[str, list[dict[str, Any]]]:
    import boto3
    import botocore.config

    from dcp_fsdp.launch.embedded_s3 import EmbeddedS3

    figures: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    server = EmbeddedS3(bucket="awslabs-save")
    endpoint = server.start()
    try:
        env = _env(endpoint.client_env(), args.nproc)
        client = boto3.client("s3", endpoint_url=endpoint.endpoint_url, region_name=endpoint.region,
                              aws_access_key_id=endpoint.access_key_id,
                              aws_secret_access_key=endpoint.secret_access_key,
                              config=botocore.config.Config(s3={"addressing_style": "path"}))
        warm_server(client, endpoint.bucket)
        for number, order in enumerate(round_orders(args.pairs)):
            load_before = load_average()
            for variant in order:
                prefix = f"{variant}-{number}"
                uri = f"s3://{endpoint.bucket}/{prefix}"
                figures[variant].append(run_awslabs(args, f"{uri}/ckpt", env, log) if variant == "awslabs"
                                        else run_tool(args, uri, endpoint.endpoint_url, env, log))
                _delete_prefix(client, endpoint.bucket, prefix + "/")
            vacuum(server)
            if args.json:  # after every round: a run cut short keeps whole rounds
                Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures}))
            print(f"round {number + 1:>2} load avg {load_before:5.2f}->{load_average():5.2f}  " + "  ".join(
                f"{v} {figures[v][-1]['slowest_s']:.3f} s {figures[v][-1]['headline']:.1f} MiB/s"
                for v in VARIANTS), flush=True)
    finally:
        server.stop()
    return figures


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        model, uri, out, threads, fsdp = sys.argv[2:7]
        return rank_main(model, uri, out, int(threads), int(fsdp))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10, help="rounds (each variant once)")
    parser.add_argument("--threads", type=int, default=8, help="writer threads per rank, both sides "
                        "(awslabs' conf/dcp_fsdp_save.yaml: 8)")
    parser.add_argument("--model", default="L660m")
    parser.add_argument("--awslabs-fsdp", type=int, choices=(1, 2), default=1,
                        help="the awslabs side's sharding: 1 as awslabs (FSDP1 ShardedTensors), 2 the "
                        "same model under FSDP2 (DTensors, as ours)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tool-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="one more dcp-fsdp setting (repeatable), e.g. request_stats=false")
    parser.add_argument("--log", default="awslabs_save.log", help="the launches' own output")
    parser.add_argument("--json", default=None, help="write every launch's figures here")
    args = parser.parse_args()
    finally_on_sigterm()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(args.log, "w") as log:
        figures = run_rounds(args, log)
    print(f"\n{args.model} fp32, {args.nproc} gloo ranks, embedded SeaweedFS, {args.threads} writer "
          f"thread(s), {args.pairs} rounds from {started}; awslabs side FSDP{args.awslabs_fsdp}; tool settings: "
          f"{' '.join(args.tool_setting) or 'defaults'}")
    print("\n".join(summary(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
