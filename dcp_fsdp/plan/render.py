"""The plan's printout: what a save and a load of this world cost, and how it projects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dcp_fsdp.units import GIB, MIB
from dcp_fsdp.config.schema import BenchmarkConfig, ReaderKind, StorageClient, StorageKind
from dcp_fsdp.config.validate import dtype_origin
from dcp_fsdp.models.llama_model_config import param_count
from dcp_fsdp.models.presets import DTYPE_BYTES, model_shape, tied_words
from dcp_fsdp.models.tensor_parallel import experts_over_shards
from dcp_fsdp.plan import requests as rq

if TYPE_CHECKING:
    from dcp_fsdp.plan.build import GlobalPlan
    from dcp_fsdp.plan.measured import MeasuredRates
    from dcp_fsdp.plan import PlanRequest
    from dcp_fsdp.plan.state import StateTemplate


def _size(value: float) -> str:
    if value >= GIB:
        return f"{value / GIB:,.2f} GiB"
    if value >= MIB:
        return f"{value / MIB:,.1f} MiB"
    return f"{value / 1024:,.1f} KiB"


def prefixes(request: PlanRequest, world_size: int) -> rq.Prefixes:
    storage = request.cfg.storage
    return rq.prefixes_for(storage.prefix_strategy.value, storage.prefix_count,
                           storage.round_robin_prefixes, world_size)


def plan_requests(request: PlanRequest, plan: GlobalPlan) -> rq.Requests:
    """The plan's S3 requests; a load's GETs from each rank's reads where the plan has them
    and the connector's default reader reads them (else each object once, whole)."""
    storage = request.cfg.storage
    reads = plan.load_reads
    if not (storage.client == StorageClient.s3torchconnector and storage.read_ahead == 0
            and storage.reader == ReaderKind.dcp_optimized):
        reads = None
    return rq.count_requests([o.size_bytes for o in plan.objects], plan.metadata_bytes,
                             plan.world_size, storage.part_size_mib * MIB, reads,
                             int(storage.max_gap_size_mib * MIB))


def render_plan(request: PlanRequest, template: StateTemplate, plan: GlobalPlan,
                elapsed_s: float) -> str:
    cfg = request.cfg
    storage = cfg.storage
    per_rank = plan.rank_bytes()
    reqs = plan_requests(request, plan)
    nodes = plan.world_size // request.ranks_per_node
    _, dtype_words = dtype_origin(cfg.model)
    lines = [
        f"plan: {cfg.model.name} {cfg.model.dtype.value}"
        + (f" ({dtype_words})" if dtype_words else "")
        + f" {cfg.state.value}, {plan.world_size} "
        f"rank(s) = {nodes} node(s) x {request.ranks_per_node}, replicas {cfg.model.replicas}"
        + (f", tp {cfg.model.tp}" if cfg.model.tp > 1 else "") + "; "
        f"storage {storage.kind.value}, thread_count {storage.thread_count}, part "
        f"{storage.part_size_mib} MiB (DCP's planner, torch's own classes; nothing started; "
        f"{elapsed_s:.1f} s)",
        model_line(cfg),
        f"state: {_size(template.state_bytes)} in {len(template.entries)} values; "
        f"{plan.items:,} write items after DCP's deduplication",
        f"bytes per rank: max {_size(max(per_rank))}, min {_size(min(per_rank))}, total "
        f"{_size(sum(per_rank))} ({sum(per_rank):,} B)",
        f"save: {len(plan.objects) + 1:,} objects ({len(plan.objects):,} data objects + .metadata; the "
        f"tool adds its manifest)",
    ]
    if storage.kind == StorageKind.s3:
        lines.append(f"  requests: {reqs.save_put:,} PUT-class (multipart: create, parts, "
                     f"complete; .metadata renamed: 1 CopyObject) + {reqs.save_delete} "
                     "DeleteObject")
        data_gets = reqs.load_get - plan.world_size * reqs.metadata_gets_per_rank
        lines.append(f"load: {reqs.load_get:,} GETs ({data_gets:,} "
                     f"ranged GETs of the data objects + {plan.world_size:,} ranks x "
                     f"{reqs.metadata_gets_per_rank} of .metadata)")
    else:
        lines.append(f"load: {len(plan.objects):,} data files read once + .metadata read by each of "
                     f"{plan.world_size:,} ranks")
    if plan.sampled:
        lines.append(f"built from a subset: {plan.sampled}; times scaled by items (--exact "
                     "builds every layer)")
    lines += [
        f".metadata: {_size(plan.metadata_bytes)} ({plan.metadata_bytes:,} B, the pickle DCP "
        f"writes); rank 0 pickles it in {plan.metadata_pickle_s:.2f} s; each rank of a load "
        f"fetches and unpickles it: {plan.metadata_unpickle_s:.2f} s per rank, "
        f"{plan.metadata_unpickle_s * plan.world_size:,.0f} CPU-s over the world",
        f"rank 0 global planning (create_global_plan over {plan.world_size:,} local plans of "
        f"{_size(plan.local_plan_bytes_max)} pickled, {_size(plan.local_plan_bytes_total)} "
        f"gathered): {plan.planning_s:.2f} s",
    ]
    lines += _prefix_lines(request, plan, reqs)
    lines += _memory_lines(request, template, plan)
    return "\n".join(lines)


def _memory_lines(request: PlanRequest, template: StateTemplate, plan: GlobalPlan) -> list[str]:
    """The largest rank's state (its block of every tensor, held whether or not it writes
    it) + the unpickled `.metadata`; and where an MoE's experts sit on a few dp shards."""
    from dcp_fsdp.plan.state import held_bytes  # plan/state imports torch

    model = request.cfg.model
    held = held_bytes(template, plan.world_size, model.replicas, model.tp)
    largest, mean = max(held), sum(held) / len(held)
    how = "scaled from the subset" if plan.sampled else "measured"
    lines = [f"memory per rank: {_size(largest + plan.metadata_memory_bytes)} = the largest "
             f"rank's state ({_size(largest)}: rank {held.index(largest)}; the mean "
             f"{_size(mean)}, the least {_size(min(held))}"
             + ("; held: every TP rank holds the tensors TP leaves whole" if model.tp > 1 else "")
             + f") + .metadata unpickled on a load ({_size(plan.metadata_memory_bytes)}, {how})"]
    crowded = experts_over_shards(model_shape(model), model.tp, model.replicas, plan.world_size)
    if crowded:
        lines.append(f"  warning: {crowded}")
    return lines


def model_line(cfg: BenchmarkConfig) -> str:
    """The model's parameter count (to hold against a model card) and what its weights take."""
    shape = model_shape(cfg.model)
    params = param_count(shape)
    weight_bytes = params * DTYPE_BYTES[cfg.model.dtype.value]
    experts = (f", {shape.num_experts} experts per sparse layer, moe_layout "
               f"{cfg.model.moe_layout.value}" if shape.num_experts else "")
    return (f"model: {params:,} parameters ({shape.family}{experts}): {weight_bytes:,} B "
            f"({_size(weight_bytes)}) of {cfg.model.dtype.value} weights"
            + tied_words(shape, cfg.model.dtype.value) + (" (in the state below)"
                                                          if shape.tie_embeddings else ""))


def render_moe_layouts(chosen: str, layouts: dict[str, Any]) -> str:
    """The expert layouts side by side: tensors, write items, .metadata, rank 0's planning."""
    lines = ["\nmodel.moe_layout (the same bytes, split into different tensors):"]
    for layout, (template, plan) in layouts.items():
        tensors = sum(1 for entry in template.entries if entry.shape is not None)
        lines.append(
            f"  {layout}{' (this plan)' if layout == chosen else ''}: {tensors:,} tensors, "
            f"{plan.items:,} write items, .metadata {_size(plan.metadata_bytes)} "
            f"({plan.metadata_bytes:,} B), rank 0 global planning {plan.planning_s:.2f} s, "
            f"pickle {plan.metadata_pickle_s:.2f} s, unpickle {plan.metadata_unpickle_s:.2f} s per rank")
    return "\n".join(lines)


def _prefix_lines(request: PlanRequest, plan: GlobalPlan, reqs: rq.Requests) -> list[str]:
    storage = request.cfg.storage
    if storage.kind != StorageKind.s3:
        return ["prefixes: storage=fs has no request limits (S3's per-prefix limits apply to "
                "storage=s3)"]
    chosen = prefixes(request, plan.world_size)
    rate = storage.throughput_target_gbps * 1e9 / 8
    load = rq.prefix_load(plan.rank_objects(), chosen, storage.part_size_mib * MIB, rate,
                          reqs.metadata_gets_per_rank)
    lines = [
        f"prefixes: storage.prefix_strategy={chosen.strategy} spreads the keys over "
        f"{chosen.count:,} prefix(es); every rank at the CRT's throughput target "
        f"({storage.throughput_target_gbps:g} Gbit/s, an upper bound): peak "
        f"{load.peak_put_per_s:,.0f} PUT/s and {load.peak_get_per_s:,.0f} GET/s on the busiest "
        f"prefix (S3: {rq.PUT_LIMIT_PER_S:,} / {rq.GET_LIMIT_PER_S:,} per second per prefix); "
        f".metadata: {load.metadata_get_burst:,} GETs of one key at a load's start (no prefix "
        f"strategy spreads them: {load.metadata_get_burst / rq.GET_LIMIT_PER_S:.1f} s at S3's limit)"]
    if load.single_rank_over:
        lines.append("  one rank alone passes a limit at this rate: no prefix count helps; raise "
                     "storage.part_size_mib (fewer parts per byte)")
    elif (load.peak_put_per_s > rq.PUT_LIMIT_PER_S or load.peak_get_per_s > rq.GET_LIMIT_PER_S):
        lines.append(f"  over S3's limit: use storage.prefix_strategy=hex "
                     f"storage.prefix_count={load.recommended_count} (or more)")
    else:
        lines.append("  within S3's limits with these settings")
    return lines


def render_projection(request: PlanRequest, plans: list[GlobalPlan], rates: MeasuredRates) -> str:
    """Save and load times per node count from the record's per-rank rates."""
    from tabulate import tabulate

    storage = request.cfg.storage
    part = storage.part_size_mib * MIB
    save_rate = rates.save_bytes_s or rates.load_bytes_s
    load_rate = rates.load_bytes_s or rates.save_bytes_s
    # read_rates measured a save or a load (else UserError): both rates are set
    assert save_rate is not None and load_rate is not None
    rows = []
    for plan in plans:
        objects = plan.rank_objects()
        chosen = prefixes(request, plan.world_size)
        puts, gets = rq.busiest_prefix_requests(objects, chosen, part)
        metadata_gets = rq.parts(plan.metadata_bytes, part) * plan.world_size
        if storage.kind != StorageKind.s3:
            puts = gets = metadata_gets = 0
        projection = rq.project(plan.world_size // request.ranks_per_node, plan.world_size,
                                max(plan.rank_bytes()), plan.planning_s, plan.metadata_bytes,
                                plan.metadata_pickle_s, plan.metadata_unpickle_s, save_rate,
                                load_rate, puts, gets, metadata_gets)
        rows.append([projection.nodes, projection.ranks, _size(max(plan.rank_bytes())),
                     _size(plan.metadata_bytes),
                     f"{projection.save_s:.2f}" + (" (prefix-bound)" if projection.save_throttled else ""),
                     f"{projection.load_s:.2f}" + (" (prefix-bound)" if projection.load_throttled else "")])
    head = (f"\nprojection from {rates.source} ({rates.samples} samples; model "
            f"{', '.join(rates.models) or '?'}; world size(s) "
            f"{', '.join(map(str, rates.world_sizes))}; storage {', '.join(rates.storage)}): "
            f"per-rank save {save_rate / MIB:,.1f} MiB/s, load {load_rate / MIB:,.1f} "
            "MiB/s (medians)\nassumes: each rank keeps the measured rate at every size (the "
            "storage and the network scale out); save = rank 0's planning + the slowest rank's "
            "bytes (or its prefix's requests at S3's limit) + pickling and writing .metadata; "
            "load = every rank's .metadata GET (one key: S3's GET limit) and unpickle + its bytes")
    table = tabulate(rows, headers=["nodes", "ranks", "bytes/rank", ".metadata", "save s",
                                    "load s"], tablefmt="simple", disable_numparse=True)
    return head + "\n" + table
