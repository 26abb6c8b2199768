"""The S3 client a run used (storage.client) in the report: the `x connector` ratio and what
the records say, or fail to say, about the client (docs/report.md)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from dcp_fsdp.analysis.sources import first_few
from dcp_fsdp.config.schema import StorageClient

CLIENT_KEY = "storage.client"
BASE_CLIENT = StorageClient.s3torchconnector.value
KNOWN_CLIENTS = tuple(client.value for client in StorageClient)


def _client(run: dict[str, Any]) -> Any:
    return (run["config"].get("storage") or {}).get("client")


def _is_s3(run: dict[str, Any]) -> bool:
    return ((run["config"].get("storage") or {}).get("kind") or (run["storage"] or {}).get("kind")) == "s3"


def _files(runs: list[dict[str, Any]]) -> str:
    return first_few([run["record_file"] for run in runs])


def fill_missing_client(settings_per_run: list[dict[str, Any]]) -> None:
    """A run's settings without storage.client, where another run's name one, take the
    connector's (the only client before the setting): no row with a blank client."""
    if any(CLIENT_KEY in settings for settings in settings_per_run):
        for settings in settings_per_run:
            settings.setdefault(CLIENT_KEY, BASE_CLIENT)


def client_notes(runs: list[dict[str, Any]]) -> list[str]:
    """Notes on S3 records without storage.client (counted as the connector's) or an unknown one."""
    notes = []
    if any(_client(run) is not None for run in runs):
        missing = [run for run in runs if _client(run) is None and _is_s3(run)]
        if missing:
            notes.append(f"{len(missing)} S3 record(s) have no storage.client (written before the "
                         f"setting, when {BASE_CLIENT} was the only client): counted as "
                         f"storage.client={BASE_CLIENT}: {_files(missing)}")
    unknown = [run for run in runs if _client(run) is not None
               and str(_client(run)) not in KNOWN_CLIENTS]
    if unknown:
        names = ", ".join(sorted({str(_client(run)) for run in unknown}))
        notes.append(f"{len(unknown)} record(s) name a storage.client this reader does not know "
                     f"({names}; it knows {', '.join(KNOWN_CLIENTS)}): their rows have no x "
                     f"connector (a record edited by hand, or a newer dcp-fsdp's: read it with "
                     f"that): {_files(unknown)}")
    return notes


def with_client_ratio(throughput: pd.DataFrame, group_keys: list[str]
                      ) -> tuple[pd.DataFrame, list[str]]:
    """Each row's aggregate MiB/s over the connector's row of the same work (every other key
    equal; NaN without one, or for an unknown client), and a note on ratios of one iteration."""
    if throughput.empty:
        return throughput, []
    if CLIENT_KEY not in group_keys:
        return throughput.assign(vs_connector=math.nan), []  # one client: no ratio to show
    others = throughput[[key for key in group_keys if key != CLIENT_KEY]]
    works = [tuple(map(str, row)) for row in others.itertuples(index=False)]
    rows = list(zip(works, throughput[CLIENT_KEY].astype(str), throughput["aggregate_mib_s"],
                    throughput["iterations"], throughput["op"]))
    by_work = {work: (figure, count) for work, client, figure, count, _ in rows if client == BASE_CLIENT}
    ratios, single = [], []
    for work, client, figure, count, op in rows:
        base_figure, base_count = by_work.get(work, (math.nan, 0))
        known = client in KNOWN_CLIENTS and base_figure > 0  # (NaN: no connector's row)
        ratios.append(figure / base_figure if known else math.nan)
        if known and client != BASE_CLIENT and min(count, base_count) < 2:
            single.append(f"{op} {client}")
    notes = [f"x connector of {len(single)} row(s) rests on a single iteration (its own "
             f"or the connector's row): no spread shows its noise, so a difference may be "
             f"chance ({', '.join(single)}); run iterations=3 or more of each client"] if single else []
    return throughput.assign(vs_connector=ratios), notes
