"""`dcp-fsdp plan --world-size N [--ranks-per-node K] [--record PATH] [--exact] [settings]`: a
save's settings compose and validate as for `save`; nothing starts."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp.compat import data_object_prefix
from dcp_fsdp.config.compose import compose
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.config.validate import check_replicas
from dcp_fsdp.errors import UserError
from dcp_fsdp.models.llama_model_config import MOE_LAYOUTS
from dcp_fsdp.models.presets import model_shape
from dcp_fsdp.models.tensor_parallel import check_tp
from dcp_fsdp.plan import PlanRequest
from dcp_fsdp.plan.render import render_moe_layouts, render_plan, render_projection
from dcp_fsdp.process.collector import paused_for_imports

if TYPE_CHECKING:
    from dcp_fsdp.plan.build import GlobalPlan
    from dcp_fsdp.plan.state import StateTemplate

# Above this many write items (world size x state values) the plan is built from a subset
# of the layers (plan/sample.py) unless --exact: ~0.3 M items take ~1 min and ~1 GB here.
EXACT_MAX_ITEMS = 300_000
DEFAULT_RANKS_PER_NODE = 8  # a GPU node's usual count; capped at world_size


def parse_request(args: argparse.Namespace) -> PlanRequest:
    """The validated request of the parsed `plan` command line, or UserError."""
    world_size = args.world_size
    ranks_per_node = args.ranks_per_node or min(DEFAULT_RANKS_PER_NODE, world_size)
    if world_size % ranks_per_node:
        raise UserError(f"--world-size={world_size}: not a multiple of --ranks-per-node="
                        f"{ranks_per_node}; give whole nodes, e.g. --world-size="
                        f"{ranks_per_node * -(-world_size // ranks_per_node)}")
    cfg = compose("save", args.settings, named="plan")
    shape = model_shape(cfg.model)  # a preset with no shape, a bad config.json: one line, here
    check_replicas(cfg.model.replicas, world_size, "--world-size", cfg.model.tp)
    check_tp(shape, cfg.model.tp, cfg.model.replicas, world_size, "--world-size")
    record = Path(args.record) if args.record else None
    return PlanRequest(world_size, ranks_per_node, record, cfg, args.exact)


def checkpoint_id(cfg: BenchmarkConfig) -> Any:
    """What the writer stamps into `.metadata` as the checkpoint's id: a Path for fs, the
    s3:// URI for s3, with a suffix of the length a save gives."""
    from dcp_fsdp.storage.layout import new_suffix

    if cfg.storage.kind == StorageKind.fs:
        return Path(cfg.storage.path or "checkpoints") / new_suffix()
    return f"{(cfg.storage.uri or 's3://dcp-fsdp/checkpoints').rstrip('/')}/{new_suffix()}"


def plan_world(request: PlanRequest, world_size: int,
               moe_layout: str | None = None) -> tuple[StateTemplate, GlobalPlan]:
    """(state template, global plan) of a save by `world_size` ranks; `moe_layout`: another
    layout than the settings' (the MoE comparison)."""
    with paused_for_imports():  # torch's and DCP's (process/collector.py)
        from dcp_fsdp.plan.build import build_global_plan
        from dcp_fsdp.plan.sample import can_sample, sampled_global_plan
        from dcp_fsdp.plan.state import state_template
        from dcp_fsdp.storage.s3_clients import prefix_strategy

    cfg = request.cfg
    template = state_template(model_shape(cfg.model), cfg.model.dtype, cfg.state,
                              moe_layout or cfg.model.moe_layout.value)
    sample = (not request.exact and world_size * len(template.entries) > EXACT_MAX_ITEMS
              and can_sample(template))
    build = sampled_global_plan if sample else build_global_plan
    # how the writer names rank r's objects (`<prefix><n>.distcp`): DCP's `__r_` for fs, the
    # store's own prefix strategy for s3 (its names are in `.metadata`)
    prefix = (data_object_prefix if cfg.storage.kind == StorageKind.fs
              else prefix_strategy(cfg.storage, world_size))
    return template, build(template, world_size, cfg.model.replicas, cfg.storage.thread_count,
                           prefix, checkpoint_id(cfg), cfg.model.tp)


def main(args: argparse.Namespace) -> int:
    from dcp_fsdp.plan.measured import read_rates  # the records' reader, for --record only

    request = parse_request(args)
    rates = read_rates(request.record) if request.record else None
    started = time.monotonic()
    template, plan = plan_world(request, request.world_size)
    print(render_plan(request, template, plan, time.monotonic() - started))
    if model_shape(request.cfg.model).num_experts:  # what the other expert layout costs
        chosen = request.cfg.model.moe_layout.value
        others = {layout: plan_world(request, request.world_size, layout)
                  for layout in MOE_LAYOUTS if layout != chosen}
        print(render_moe_layouts(chosen, {chosen: (template, plan), **others}))
    if rates is not None:  # 1, 2, 4, ... nodes, each a whole number of the mesh's rows
        group = request.cfg.model.replicas * request.cfg.model.tp
        doubled = (request.ranks_per_node << i for i in range(request.world_size.bit_length()))
        sizes = [size for size in doubled if size < request.world_size and size % group == 0]
        plans = [plan_world(request, size)[1] for size in sizes] + [plan]
        print(render_projection(request, plans, rates))
    return 0
