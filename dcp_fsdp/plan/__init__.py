"""`dcp-fsdp plan`: DCP's own save plan for a world you do not have, built in one process
with no ranks and no storage I/O (docs/plan.md)."""

import dataclasses
from pathlib import Path

from dcp_fsdp.config.schema import BenchmarkConfig


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What `dcp-fsdp plan` is asked: the world to plan for and the settings of the save."""

    world_size: int
    ranks_per_node: int
    record: Path | None
    cfg: BenchmarkConfig
    exact: bool = False  # build every layer even for a large world
