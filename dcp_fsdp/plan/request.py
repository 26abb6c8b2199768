"""What `dcp-fsdp plan` is asked: the world to plan for and the settings of the save."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dcp_fsdp.config.schema import BenchmarkConfig


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    world_size: int
    ranks_per_node: int
    record: Path | None
    cfg: BenchmarkConfig
    exact: bool = False  # build every layer even for a large world
