"""One rank's run: join the group, build the sharded model, loop, record, report.

Runs identically under torchrun (env:// rendezvous, any number of nodes) and
under our local launcher. Everything before the loop's first barrier is
initialisation: measured, recorded apart, never inside a timed region.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
import traceback
import warnings
from typing import Any

from omegaconf import OmegaConf

from dcp_fsdp.config import BenchmarkConfig, Command
from dcp_fsdp.errors import BenchmarkFailure, UserError

EMBEDDED_ENV = "DCP_FSDP_EMBEDDED_S3"  # set by the launcher when it started the embedded server
RUN_ID_ENV = "DCP_FSDP_RUN_ID"
PREFLIGHT_DONE_ENV = "DCP_FSDP_PREFLIGHT_DONE"

EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class Terminated(BaseException):
    """SIGTERM (scancel, torchrun stopping the group): end like Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Terminated()


# The connector's errors once its CRT client has used up storage.max_attempts, and the fix.
_S3_HINTS = (
    (("Request throttled",),
     "S3 throttled every attempt (HTTP 503 SlowDown): retries exhausted; raise "
     "storage.max_attempts or lower the request rate, e.g. fewer ranks or threads"),
    (("AWS_IO_SOCKET_CLOSED", "AWS_ERROR_HTTP_CONNECTION_CLOSED", "AWS_IO_SOCKET_TIMEOUT",
      "AWS_IO_SOCKET_CONNECTION_REFUSED"),
     "the connection to S3 failed on every attempt: retries exhausted; check the endpoint "
     "and the network, or raise storage.max_attempts"),
)


def root_cause(error: BaseException) -> str:
    """One line: for DCP's CheckpointException, the failing ranks and their innermost errors
    (ranks with the same error named together), plus a hint for S3 retries exhausted."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        ranks_by_text: dict[str, list[int]] = {}
        for rank, wrapped in sorted(error.failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            ranks_by_text.setdefault(_innermost(exc), []).append(rank)
        parts = [f"{_ranks(ranks)}: {text}" for text, ranks in ranks_by_text.items()]
        line = "; ".join(parts[:2]) + (f" (+{len(parts) - 2} more errors)" if len(parts) > 2 else "")
    else:
        line = _innermost(error)
    hint = next((hint for needles, hint in _S3_HINTS if any(n in line for n in needles)), None)
    return f"{line} ({hint})" if hint else line


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(rank) for rank in ranks[:4])
    return f"ranks {shown}" + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def _innermost(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split()) or repr(error)
    return f"{type(error).__name__}: {text[:400]}"


def collective_error(error: BaseException) -> bool:
    """Errors every rank raises together (only rank 0 needs to print them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(error, (UserError, BenchmarkFailure, CheckpointException))


def config_dict(cfg: BenchmarkConfig) -> dict[str, Any]:
    from dcp_fsdp.records import redact_url

    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    resolved["storage"]["endpoint"] = redact_url(resolved["storage"]["endpoint"])
    return resolved


def run_rank(cfg: BenchmarkConfig, process_start_mono: float) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")

    from dcp_fsdp import records, s3_requests
    from dcp_fsdp.config import StorageKind

    # Before anything creates an S3 client: the connector reads its log settings once.
    request_log = (s3_requests.enable(os.environ.get("RANK", "0"), cfg.keep_request_log)
                   if cfg.storage.kind == StorageKind.s3 else None)
    from dcp_fsdp.distributed import broadcast_object, init_distributed, shutdown
    from dcp_fsdp.llama_model_config import PRESETS
    from dcp_fsdp.loop import CheckpointLoop, make_state_dict, rank0_decides, state_bytes
    from dcp_fsdp.model import build_sharded_model
    from dcp_fsdp.storage import check_loadable, make_backend

    started_at = records.utc_now()
    ctx = None
    loop = None
    run: dict[str, Any] = {"command": cfg.command.value, "argv": records.command_line(),
                           "started_at": started_at, "config": config_dict(cfg)}
    init: dict[str, Any] = {}
    status, error_line, exit_code = "ok", None, EXIT_OK

    def write_record(status: str, error_line: str | None, samples, init_rows):
        run.update(status=status, error=error_line, finished_at=records.utc_now(),
                   suffixes=list(loop.suffixes) if loop is not None else [],
                   integrity=dict(loop.integrity) if loop is not None else {},
                   init=init_rows, versions=records.versions(),
                   slurm=records.slurm_environment())
        return records.write_records(records.record_path(cfg.results_dir, run["run_id"]),
                                     run, list(samples))
    try:
        t0 = time.monotonic()
        ctx = init_distributed(cfg.backend, cfg.collective_timeout_s)
        init["pg_init_s"] = time.monotonic() - t0
        log = print if ctx.is_coordinator else (lambda message: None)
        run_id = broadcast_object(os.environ.get(RUN_ID_ENV) or records.new_run_id(cfg.command.value))
        run["run_id"] = run_id

        backend = make_backend(cfg.storage)

        def preflight() -> None:
            if os.environ.get(PREFLIGHT_DONE_ENV) != "1":
                backend.preflight()
                if cfg.command == Command.load:
                    check_loadable(backend, cfg.suffix)
        rank0_decides(ctx, preflight)

        t0 = time.monotonic()
        sharded = build_sharded_model(cfg.model.preset, cfg.model.dtype, cfg.state, ctx.device,
                                      ctx.world_size, cfg.seed)
        init["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        state_dict = make_state_dict(sharded)
        init["state_dict_s"] = time.monotonic() - t0
        shape = PRESETS[cfg.model.preset]
        run["model"] = {"preset": cfg.model.preset, "family": shape.family,
                        "dtype": cfg.model.dtype.value, "state": cfg.state.value,
                        "param_count": sharded.param_count, "param_bytes": sharded.param_bytes,
                        "state_bytes": state_bytes(state_dict)}
        run.update(world_size=ctx.world_size, node_count=ctx.node_count,
                   nproc_per_node=ctx.local_world_size, hostnames=list(ctx.hostnames),
                   backend=ctx.backend, device=str(ctx.device))
        run["storage"] = {**backend.describe(), "embedded": os.environ.get(EMBEDDED_ENV) == "1"}
        if ctx.is_coordinator:
            model = run["model"]
            print(f"[dcp-fsdp] run {run_id}: {cfg.command.value} model={model['preset']} "
                  f"({model['param_count'] / 1e9:.3f} B params, {model['dtype']}, {model['state']}, "
                  f"{model['state_bytes'] / 2**20:.1f} MiB) world_size={ctx.world_size} "
                  f"nodes={ctx.node_count} backend={ctx.backend} "
                  f"storage={backend.location('')}", flush=True)
        init["init_s"] = time.monotonic() - process_start_mono

        def on_timeout(message: str) -> None:
            # From the watchdog thread, while the main thread is stuck in native code:
            # record the failure (rank 0), say it once, and end the process.
            print(f"dcp-fsdp: error: rank {ctx.rank}: {message}", file=sys.stderr, flush=True)
            if ctx.is_coordinator:
                write_record("failed", message, loop.samples if loop else [], [init])
            os._exit(EXIT_FAILED)

        loop = CheckpointLoop(cfg, ctx, backend, sharded, state_dict,
                              log=lambda message: log(f"[dcp-fsdp] {message}"),
                              on_timeout=on_timeout)
        loop.run()
    except (KeyboardInterrupt, Terminated) as error:
        status, exit_code = "interrupted", EXIT_INTERRUPTED
        error_line = "interrupted by " + ("SIGTERM" if isinstance(error, Terminated) else "SIGINT")
    except UserError as error:
        status, error_line, exit_code = "failed", str(error), EXIT_USER_ERROR
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        status, error_line, exit_code = "failed", root_cause(error), EXIT_FAILED
        if os.environ.get("DCP_FSDP_DEBUG"):
            traceback.print_exc()
        if ctx is None or not collective_error(error) or ctx.is_coordinator:
            prefix = f"rank {ctx.rank}: " if ctx is not None and not collective_error(error) else ""
            print(f"dcp-fsdp: error: {prefix}{error_line}", file=sys.stderr, flush=True)
    if exit_code == EXIT_USER_ERROR and (ctx is None or ctx.is_coordinator):
        print(f"dcp-fsdp: error: {error_line}", file=sys.stderr, flush=True)

    if request_log is not None:
        init["untimed_requests"] = request_log.finish()
        kept = request_log.close(cfg.results_dir, run.get("run_id"),
                                 ctx.rank if ctx else os.environ.get("RANK", "0"))
        if kept:
            run["request_log_dir"] = str(kept.parent)
    # Peak resident memory of this rank (Linux reports KiB): what a node must hold per rank.
    init["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    samples = loop.samples if loop is not None else []
    init_rows = [{"rank": ctx.rank if ctx else int(os.environ.get("RANK", 0)), **init}]
    if status == "ok":
        # Everyone succeeded: collect every rank's samples. (After a failure ranks may be
        # out of step, so rank 0 records only what it saw rather than risk a hang.)
        from dcp_fsdp.distributed import all_gather_object

        gathered = all_gather_object((samples, init_rows[0]))
        samples = [s for rank_samples, _ in gathered for s in rank_samples]
        init_rows = [row for _, row in gathered]
    is_coordinator = ctx.is_coordinator if ctx is not None else os.environ.get("RANK", "0") == "0"
    if is_coordinator and run.get("run_id"):
        if request_log is not None:
            # requests made outside every timed region, all ranks (per rank: just the count)
            untimed = [row.pop("untimed_requests", None) for row in init_rows]
            run["untimed_requests"] = s3_requests.merge_summaries(untimed)
            for row, summary in zip(init_rows, untimed):
                row["untimed_request_count"] = summary["count"] if summary else None
        path = write_record(status, error_line, samples, init_rows)
        if status == "ok":
            print_summary(run, samples)
        print(f"[dcp-fsdp] record: {path}", flush=True)
        if loop is not None and loop.suffixes and cfg.command != Command.load:
            print(f"[dcp-fsdp] SUFFIXES={','.join(loop.suffixes)}", flush=True)
    if status != "interrupted":
        try:
            shutdown(aligned=status == "ok")
        except BaseException:
            pass
    return exit_code


def print_summary(run: dict[str, Any], samples) -> None:
    import dataclasses

    from tabulate import tabulate

    from dcp_fsdp.metrics import run_table

    headers, rows = run_table({"run_id": run["run_id"], **dataclasses.asdict(s)} for s in samples)
    model = run["model"]
    print(f"\n{run['command']} of {model['preset']} ({model['dtype']}, {model['state']}) on "
          f"{run['world_size']} rank(s) / {run['node_count']} node(s), "
          f"storage {run['storage']['kind']}{' (embedded SeaweedFS)' if run['storage'].get('embedded') else ''}")
    print(tabulate(rows, headers=headers, tablefmt="github"))
    init_s = [row.get("init_s") for row in run["init"] if row.get("init_s") is not None]
    if init_s:
        print(f"init (untimed, not in any figure above): {max(init_s):.1f} s max over ranks")
    print(flush=True)
