"""Result records: one JSON Lines file per run, everything needed to recompute a table.

Line 1 is the run (`"record": "run"`): configuration, model, cluster, status.
Every further line is one rank's measurement of one save or load
(`"record": "sample"`). See the README's "Record format" section.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import secrets
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

SCHEMA_VERSION = 1
# Job id, node count, node list and tasks per node (SLURM_NTASKS_PER_NODE is set only when
# --ntasks-per-node was given; SLURM_TASKS_PER_NODE always is, e.g. "1(x8)").
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
                   "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                   "SLURM_CLUSTER_NAME", "SLURM_JOB_PARTITION")


def new_run_id(command: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{command}-{secrets.token_hex(3)}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("dcp_fsdp", "torch", "s3torchconnector", "transformers", "boto3"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def slurm_environment() -> dict[str, str] | None:
    found = {name.lower().removeprefix("slurm_"): os.environ[name]
             for name in SLURM_VARIABLES if name in os.environ}
    return found or None


def redact_url(url: str | None) -> str | None:
    """Drop any user:password@ from a URL before it is written anywhere."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url


def record_path(results_dir: str, run_id: str) -> Path:
    return Path(results_dir) / f"{run_id}.jsonl"


def write_records(path: Path, run: dict[str, Any], samples: Iterable[Any]) -> Path:
    """Write the run line and sample lines atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as out:
        out.write(json.dumps({"record": "run", "schema_version": SCHEMA_VERSION, **run}) + "\n")
        for sample in samples:
            row = dataclasses.asdict(sample) if dataclasses.is_dataclass(sample) else dict(sample)
            out.write(json.dumps({"record": "sample", "run_id": run["run_id"], **row}) + "\n")
    os.replace(tmp, path)
    return path


def read_records(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, samples) from record files; lines of unknown kinds are skipped."""
    runs, samples = [], []
    for path in paths:
        with open(path) as source:
            for line in source:
                line = line.strip()
                if not line:
                    continue
                row = json.loads(line)
                if row.get("record") == "run":
                    runs.append(row)
                elif row.get("record") == "sample":
                    samples.append(row)
    return runs, samples


ARGV_ENV = "DCP_FSDP_ARGV"  # the user's command line, passed by the launcher to its ranks


def command_line() -> list[str]:
    if os.environ.get(ARGV_ENV):
        return json.loads(os.environ[ARGV_ENV])
    program = Path(sys.argv[0]).name
    if program == "__main__.py":  # `python -m dcp_fsdp` or `torchrun ... -m dcp_fsdp`
        program = "python -m dcp_fsdp"
    return [program] + sys.argv[1:]
