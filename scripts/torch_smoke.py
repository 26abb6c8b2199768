"""The smoke run on one torch release (scripts/torch_smoke.sh builds its venv), all on one
SeaweedFS it starts on 127.0.0.1: a sync save by 1 rank loaded by 2 (a resharded load), async
thread and async process save-and-load, and a report. Any failure, or a traceback, fails it.

Run with the venv's python from the repository root: python scripts/torch_smoke.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dcp_fsdp.launch.embedded_s3 import EmbeddedS3  # noqa: E402

TINY = ["nproc=2", "iterations=2"]
# Each after the sync save of 1 rank and its load by 2 (main): the async checkpointers,
# whose seams into torch (compat.py) are the ones most likely to move between releases.
RUNS = {
    "async-thread": ["save-and-load", *TINY, "save_mode=async",
                     "async_save.checkpointer=thread"],
    "async-process": ["save-and-load", *TINY, "save_mode=async",
                      "async_save.checkpointer=process"],
}


def dcp_fsdp(args: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "dcp_fsdp", *args], capture_output=True,
                            text=True, cwd=REPO, env=env, stdin=subprocess.DEVNULL, timeout=600)
    elapsed_s = time.monotonic() - started
    if result.returncode or "Traceback" in result.stderr:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
        raise SystemExit(f"torch-smoke: FAILED: dcp-fsdp {' '.join(args)} "
                         f"(exit {result.returncode})")
    return result.stdout, elapsed_s


def record(results_dir: Path) -> tuple[dict, list[dict]]:
    (path,) = results_dir.glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines[0], lines[1:]


def done(name: str, elapsed_s: float) -> None:
    import torch

    print(f"torch-smoke: torch {torch.__version__}: {name}: ok in {elapsed_s:.1f} s", flush=True)


def check(results_dir: Path, name: str, loads: bool = True) -> dict:
    """The run is ok and, where it loads, every load was verified against what was saved."""
    run, samples = record(results_dir)
    if run["status"] != "ok" or (loads and not run["integrity"]) or not all(
            entry["checked"] for entry in run["integrity"].values()):
        raise SystemExit(f"torch-smoke: FAILED: {name}: status {run['status']}, "
                         f"integrity {run['integrity']}")
    if not samples:
        raise SystemExit(f"torch-smoke: FAILED: {name}: no samples recorded")
    return run


def main() -> int:
    import os

    import torch

    # The release this venv was built for (scripts/torch_smoke.sh passes it): a venv that holds
    # another would report that one's smoke under this one's name.
    expected = sys.argv[1] if len(sys.argv) > 1 else None
    if expected is not None and torch.__version__.split("+")[0] != expected:
        raise SystemExit(f"torch-smoke: FAILED: the venv for torch {expected} holds torch "
                         f"{torch.__version__}; rebuild it (rm -r .venv-torch-{expected})")
    work = Path(tempfile.mkdtemp(prefix="dcp-fsdp-smoke-"))
    server = EmbeddedS3(bucket="smoke")
    try:
        server.start()
        s3 = server.endpoint
        assert s3 is not None  # started
        env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key_id,
               "AWS_SECRET_ACCESS_KEY": s3.secret_access_key}
        where = [f"storage.uri=s3://{s3.bucket}/smoke", f"storage.endpoint={s3.endpoint_url}",
                 "model=tiny_llama"]
        _, save_s = dcp_fsdp(["save", *where, "nproc=1", f"results_dir={work / 'save-1'}"], env)
        suffix = check(work / "save-1", "save nproc=1", loads=False)["suffixes"][0]
        _, load_s = dcp_fsdp(["load", *where, "nproc=2", f"suffix={suffix}",
                              f"results_dir={work / 'load-2'}"], env)
        run = check(work / "load-2", "resharded load")
        if run["world_size"] != 2:
            raise SystemExit(f"torch-smoke: FAILED: resharded load ran {run['world_size']} ranks")
        done("sync save nproc=1, resharded load nproc=2", save_s + load_s)

        for name, args in RUNS.items():
            _, elapsed_s = dcp_fsdp([*args, *where, f"results_dir={work / name}"], env)
            check(work / name, name)
            done(name, elapsed_s)

        report, elapsed_s = dcp_fsdp(["report", *(str(p) for p in sorted(work.iterdir()))])
        if "save" not in report:
            raise SystemExit("torch-smoke: FAILED: the report shows no save")
        done("report", elapsed_s)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"torch-smoke: torch {torch.__version__}: passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
