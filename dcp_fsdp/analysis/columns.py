"""The report tables' columns: which figure, its header, its format, and its place in the
compact terminal view (`compact`: None for the full views only, else a rank: when the
terminal is too narrow, the highest ranks go first). Definitions: docs/report.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple


class Column(NamedTuple):
    names: str | tuple[str, ...]
    header: str
    spec: str  # a format spec, "int", "%" (ratio as percent) or "s" (text)
    # latency is shown per request type only (TYPES): pooled over types it would mix
    # UploadParts with HEADs
    compact: int | None


def cell(value: Any, spec: str) -> str:
    """A figure as text by a Column's spec; blank where it is unknown (None, NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if spec == "s":
        return str(value)
    if spec == "int":
        return f"{int(round(value))}"
    if spec == "%":
        return f"{100 * value:.2f}"
    return format(value, spec)


THROUGHPUT = [
    Column("runs", "runs", "int", 3),
    Column("iterations", "iters", "int", 2),
    Column("checkpoint_gib", "GiB", ".3f", 4),
    Column("duration_mean_s", "dur mean s", ".3f", None),
    Column("duration_p50_s", "dur p50 s", ".3f", 6),
    Column("duration_p90_s", "dur p90 s", ".3f", None),
    Column("aggregate_mib_s", "agg MiB/s", ".1f", 0),
    # storage.client varying: agg MiB/s over the connector's for the same work (README "Report")
    Column("vs_connector", "x connector", ".2f", 0),
    # iteration 1 (a process's first: cold, as a restart) / the rest (warm)
    Column(("first_mib_s", "later_mib_s"), "MiB/s first/later", ".1f", 3),
    Column(("first_dur_s", "later_dur_s"), "dur s first/later", ".3f", None),
    Column("slowest_rank_mib_s", "slowest-rank MiB/s", ".1f", 6),
    Column("spread", "spread %", "%", 3),
    Column("efficiency", "efficiency", ".2f", 1),
    Column("mib_s_per_node", "MiB/s/node", ".1f", 9),
    Column("stall_mean_s", "stall s", ".3f", 1),
    Column("train_lost_share", "train lost %", "%", 1),
    Column("persisted_mib_s", "MiB/s persisted", ".1f", 1),
    Column("fetched_ratio", "fetched/bytes", ".2f", 5),
    Column("egress_mib_per_op", "egress MiB/op", ".1f", 5),
    Column(("rank_s_min", "rank_s_median", "rank_s_max"), "rank s min/med/max", ".3f", 7),
    Column("requests_per_op", "req/op", ".1f", None),
    Column("req_per_s", "req/s", ".1f", None),
    Column("failures", "failures", "int", None),
    Column("throttles", "throttles", "int", None),
    Column("failed_runs", "failed runs", "int", 2),
    Column("note", "note", "s", 0),
]
REQUESTS = [
    Column("requests_per_op", "req/op", ".1f", 0),
    Column("req_per_s", "req/s", ".1f", 1),
    Column("success_ratio", "success %", "%", 4),
    Column("failures", "failures", "int", 2),
    Column("throttles", "throttles", "int", 3),
    Column("retries", "retries", "int", 5),
    Column("misses", "misses", "int", 7),
    Column("ttfb_p50_ms", "ttfb p50 ms", ".2f", 6),
    Column("untimed_per_run", "untimed req/run", ".1f", 8),
]
PHASES = [
    Column("plan_s", "plan s", ".3f", 1),
    Column("io_s", "io s", ".3f", 1),
    Column("commit_s", "commit s", ".3f", 1),
    Column("metadata_s", "metadata read s", ".3f", 6),
    Column("finish_s", "metadata write s", ".3f", 6),
    Column("storage_s", "in client s", ".3f", 2),
    Column("deserialise_s", "deserialise s", ".3f", 2),
    Column("target_copy_s", "copy to tensors s", ".3f", 2),
    # before schema 8: the time inside the streams' reads (copies and faults included)
    Column("io_wait_s", "io wait s (old)", ".3f", None),
    Column("copy_s", "copy s (old)", ".3f", None),
    Column("stage_s", "serialise s", ".3f", 2),
    Column("upload_s", "upload s", ".3f", 2),
    Column("fresh_pages_per_byte", "fresh pages/B", ".2f", 2),
    Column("blocked_s", "blocked s", ".3f", 1),
    Column("staged_s", "staged s", ".3f", 5),
    Column("persisted_s", "persisted s", ".3f", 1),
    Column("previous_wait_s", "prev wait s", ".3f", 5),
    Column("train_steps", "train steps", ".1f", None),
    Column("train_step_slowdown", "step slowdown", ".3f", 4),
    Column("stall_s", "stall s", ".3f", 1),
    Column("train_lost_s", "train lost s", ".3f", 4),
    Column("train_wait_s", "steps wait s", ".3f", 5),
    Column("peak_rss_gib", "peak RSS GiB", ".2f", 1),
    Column("cuda_max_allocated_gib", "CUDA max GiB", ".2f", 1),
    Column(("barrier_wait_mean_s", "barrier_wait_max_s"), "barrier wait mean/max s", ".3f", 7),
    Column(("end_skew_mean_s", "end_skew_max_s"), "end skew mean/max s", ".3f", 7),
    Column("slowest_rank", "slowest rank", "int", 8),
    Column("slowest_lag_s", "slowest - median s", ".3f", 8),
]
TYPES = [
    Column("request_type", "request type", "s", 0),
    Column("requests_per_op", "req/op", ".1f", 0),
    Column("mib_per_op", "MiB/op", ".1f", 1),
    Column("failures", "failures", "int", 2),
    Column("misses", "misses", "int", 5),
    Column("throttles", "throttles", "int", 3),
    Column("retries", "retries", "int", 4),
    Column("latency_p50_ms", "lat p50 ms", ".2f", 2),
    Column("latency_p99_ms", "lat p99 ms", ".2f", 3),
    Column("latency_max_ms", "lat max ms (<=)", ".1f", None),
]
