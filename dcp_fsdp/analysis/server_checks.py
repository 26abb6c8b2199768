"""What the records' `server_requests` say (storage.metrics_url, launch/server_check.py): a
report note per run whose request counts differ from its S3 server's own counters, and one
for the runs that were checked and agree."""

from __future__ import annotations

from typing import Any

from dcp_fsdp.telemetry.server_counters import RESENT_BELOW_CLIENT


def server_check_notes(runs: list[dict[str, Any]]) -> list[str]:
    checked = [run for run in runs if run["server_requests"] is not None]
    differing = [run for run in checked if not run["server_requests"].get("match")]
    notes = []
    for run in differing:
        check = run["server_requests"]
        differences = ", ".join(f"{k} {v:+d}" for k, v in (check.get("differences") or {}).items())
        incomplete = "; ".join(check.get("incomplete") or [])
        notes.append(f"run {run['run_id']}: its request counts differ from the S3 server's "
                     f"own counters (record - server: {differences or 'none'}"
                     + (f"; {incomplete}" if incomplete else "") + f"): {_cause(check)}")
    if checked and not differing:
        notes.append(f"request counts of {len(checked)} run(s) checked against their S3 "
                     "server's own counters (storage.metrics_url): all match")
    return notes


def _cause(check: dict[str, Any]) -> str:
    """Why they differ, where the run shows it (server_counters.compare's `cause`)."""
    causes = {"server_restarted": "the server restarted during the run (its counters went back)",
              "unanswered_requests": (f"{check.get('unanswered')} request(s) got no answer before the "
                                      "client gave up (the server counts them when it answers: after "
                                      "the check, or under a status the client never saw)"),
              "resent_below_client": RESENT_BELOW_CLIENT}
    return causes.get(str(check.get("cause")), "another client of the bucket, or a misread request log")
