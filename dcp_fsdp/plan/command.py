"""`dcp-fsdp plan model=... state=... world_size=N ranks_per_node=K [record=PATH] [settings]`.

The settings of a save (model, state, storage, replicas, part size, prefix strategy, thread
count) compose and validate as for `save`; `world_size`, `ranks_per_node` and `record` are
the plan's own and are taken off first. Nothing starts: no rank, no storage request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp.compat import data_object_prefix
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.plan.request import PlanRequest

if TYPE_CHECKING:
    from dcp_fsdp.plan.build import GlobalPlan
    from dcp_fsdp.plan.state import StateTemplate

PLAN_KEYS = ("world_size", "ranks_per_node", "record", "exact")
# Above this many write items (world size x state values) the plan is built from a subset
# of the layers (plan/sample.py) unless exact=true: ~0.3 M items take ~1 min and ~1 GB here.
EXACT_MAX_ITEMS = 300_000
DEFAULT_RANKS_PER_NODE = 8  # a GPU node's usual count; capped at world_size


def _whole(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{name}={text}: give a whole number, 1 or more") from None
    if value < 1:
        raise UserError(f"{name}={value}: must be 1 or more")
    return value


def split_plan_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the plan's own key=value pairs, every other override)."""
    own: dict[str, str] = {}
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in PLAN_KEYS:
            own[key] = value
        else:
            rest.append(arg)
    return own, rest


def parse_request(args: list[str]) -> PlanRequest:
    """The validated request, or UserError naming the setting and the fix."""
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.config.validate import check_replicas
    from dcp_fsdp.models.presets import model_shape
    from dcp_fsdp.models.tensor_parallel import check_tp

    own, rest = split_plan_args(args)
    if "world_size" not in own:
        raise UserError("world_size: required; give the ranks of the world to plan, e.g. "
                        "world_size=1024 ranks_per_node=8")
    world_size = _whole("world_size", own["world_size"])
    ranks_per_node = (_whole("ranks_per_node", own["ranks_per_node"]) if "ranks_per_node" in own
                      else min(DEFAULT_RANKS_PER_NODE, world_size))
    if world_size % ranks_per_node:
        raise UserError(f"world_size={world_size}: not a multiple of ranks_per_node="
                        f"{ranks_per_node}; give whole nodes, e.g. world_size="
                        f"{ranks_per_node * -(-world_size // ranks_per_node)}")
    cfg = compose("save", rest, named="plan")
    shape = model_shape(cfg.model)  # a preset with no shape, a bad config.json: one line, here
    check_replicas(cfg.model.replicas, world_size, "world_size", cfg.model.tp)
    check_tp(shape, cfg.model.tp, cfg.model.replicas, world_size, "world_size")
    record = Path(own["record"]) if own.get("record") else None
    exact = own.get("exact", "false").lower()
    if exact not in ("true", "false"):
        raise UserError(f"exact={own['exact']}: give true or false")
    return PlanRequest(world_size, ranks_per_node, record, cfg, exact == "true")


def rank_prefix_function(cfg: BenchmarkConfig, world_size: int) -> Callable[[int], str]:
    """How the writer names rank r's objects (`<prefix><n>.distcp`): DCP's `__r_` for fs, the
    store's own prefix strategy for s3 (its names are in `.metadata`)."""
    if cfg.storage.kind == StorageKind.fs:
        return data_object_prefix
    from dcp_fsdp.storage.s3 import prefix_strategy

    return prefix_strategy(cfg.storage, world_size)


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
    from dcp_fsdp.models.presets import model_shape
    from dcp_fsdp.process.collector import paused_for_imports

    with paused_for_imports():  # torch's and DCP's (process/collector.py)
        from dcp_fsdp.plan.build import build_global_plan
        from dcp_fsdp.plan.sample import can_sample, sampled_global_plan
        from dcp_fsdp.plan.state import state_template

    cfg = request.cfg
    template = state_template(model_shape(cfg.model), cfg.model.dtype, cfg.state,
                              moe_layout or cfg.model.moe_layout.value)
    sample = (not request.exact and world_size * len(template.entries) > EXACT_MAX_ITEMS
              and can_sample(template))
    build = sampled_global_plan if sample else build_global_plan
    return template, build(template, world_size, cfg.model.replicas, cfg.storage.thread_count,
                           rank_prefix_function(cfg, world_size), checkpoint_id(cfg),
                           cfg.model.tp)


def main(args: list[str]) -> int:
    import time

    from dcp_fsdp.models.llama_model_config import MOE_LAYOUTS
    from dcp_fsdp.models.presets import model_shape
    from dcp_fsdp.plan.measured import read_rates
    from dcp_fsdp.plan.render import render_moe_layouts, render_plan, render_projection

    request = parse_request(args)
    rates = read_rates(request.record) if request.record else None
    started = time.monotonic()
    template, plan = plan_world(request, request.world_size)
    print(render_plan(request, template, plan, time.monotonic() - started))
    if model_shape(request.cfg.model).num_experts:  # what the other expert layout costs
        chosen = request.cfg.model.moe_layout.value
        layouts = {chosen: (template, plan)}
        for layout in MOE_LAYOUTS:
            if layout != chosen:
                layouts[layout] = plan_world(request, request.world_size, layout)
        print(render_moe_layouts(chosen, layouts))
    if rates is not None:
        sizes = []
        nodes = 1
        group = request.cfg.model.replicas * request.cfg.model.tp  # the mesh's whole rows
        while nodes * request.ranks_per_node < request.world_size:
            if nodes * request.ranks_per_node % group == 0:
                sizes.append(nodes * request.ranks_per_node)
            nodes *= 2
        plans = [plan_world(request, size)[1] for size in sizes] + [plan]
        print(render_projection(request, plans, rates))
    return 0


