"""Private torch / connector internals, in one place (the `torch` engineer owns this module;
the function below came from the `tune` branch: merge it in)."""

from __future__ import annotations


def save_planner(plan_caching: bool, cache_key: str):
    """DCP's DefaultSavePlanner with save plan caching, or None (DCP's default planner).

    Private: `_cached_plans_key`. DCP caches plans in class-level dicts keyed by the
    planner's class name, so every planner of a process shares one cache; the final local
    plans it replays carry the storage writer's `prepare_global_plan` output (file
    prefixes). A key per writer layout (`cache_key`) keeps a save with another prefix
    strategy (tune changes it between trials in one process) from replaying stale plans.
    `enable_plan_caching` exists in torch 2.11, 2.13 and 2.15.
    """
    if not plan_caching:
        return None
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = f"{type(planner).__name__}:{cache_key}"
    return planner
