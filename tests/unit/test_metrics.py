"""Metric definitions, on hand-made samples with known answers."""

from dcp_fsdp.units import MIB
from dcp_fsdp.analysis.metrics import per_operation, run_figures, samples_frame


def sample(rank, begin, end, nbytes, op="save", iteration=1):
    return {"run_id": "r", "op": op, "iteration": iteration, "suffix": "s", "rank": rank,
            "begin_wall_s": begin, "end_wall_s": end, "duration_s": end - begin,
            "bytes": nbytes, "barrier_wait_s": 0.0}


def test_aggregate_is_total_bytes_over_first_begin_to_last_end():
    samples = [sample(0, 100.0, 102.0, 100 * MIB), sample(1, 100.5, 104.0, 100 * MIB)]
    row = per_operation(samples_frame(samples)).iloc[0]
    assert row["span_s"] == 4.0
    assert row["aggregate_mib_s"] == 200 / 4.0
    assert row["end_skew_s"] == 2.0
    assert row["rank_mib_s_min"] == 100 / 3.5 and row["rank_mib_s_max"] == 50.0


def test_run_table_has_a_row_per_op_iteration_and_a_summary():
    samples = [sample(r, 10.0 * i, 10.0 * i + 1 + r, MIB, op=op, iteration=i)
               for i in (1, 2) for op in ("save", "load") for r in (0, 1)]
    headers, rows, _ = run_figures(samples)
    assert [row[0] for row in rows] == ["save", "load", "save", "load", "save (all)", "load (all)"]
    assert rows[0][5] == f"{2 / 2.0:.1f}"  # 2 MiB over a 2 s span
