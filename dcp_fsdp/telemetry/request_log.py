"""S3 request statistics from the connector's own per-request log lines (docs/metrics.md
"S3 request statistics": what each figure counts, how a request is classified, and why a
request belongs to the operation its meta request began in, read after SETTLE_S at most).

s3torchconnector has no statistics API, but its native client logs one line per HTTP
request when `S3_TORCH_CONNECTOR_DEBUG_LOGS` is set, into hourly files under
`S3_TORCH_CONNECTOR_LOGS_DIR_PATH`; each rank gets its own directory (processes sharing one
would interleave lines). Parsing the lines: `connector_log.py`; boto3's calls: an event hook
(`control_plane.py`).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from dcp_fsdp import log
from dcp_fsdp.compat import installed_version
from dcp_fsdp.process.failures import ErrorAnswers
from dcp_fsdp.process.lifeline import owned_tempdir
from dcp_fsdp.telemetry import summaries
from dcp_fsdp.telemetry.connector_log import LogParser, Unparsed, version_problem
from dcp_fsdp.telemetry.control_plane import install_data_plane_hook
from dcp_fsdp.telemetry.request import Request

DEBUG_LOGS_ENV = "S3_TORCH_CONNECTOR_DEBUG_LOGS"
LOGS_DIR_ENV = "S3_TORCH_CONNECTOR_LOGS_DIR_PATH"
LOG_FILTER = "debug,awscrt=off"  # the connector's request lines; none of the CRT's own
SETTLE_S = 2.0  # the longest wait after an operation for its meta requests to log their end
FAILED_SETTLE_S = 1.0  # the same after an operation failed (its rank's line waits on it)
_POLL_S = 0.01


# -- the per-process log -----------------------------------------------------------------

class RequestLog:
    """This process's connector log: read incrementally, split into timed windows."""

    def __init__(self, directory: Path, keep_raw: bool = False,
                 settle_s: float = SETTLE_S, client: str = "s3torchconnector") -> None:
        self.directory = Path(directory)
        self.client = client  # storage.client: whose requests (its log, or botocore's hooks)
        self.keep_raw = keep_raw
        self.settle_s = settle_s
        self._offsets: dict[str, int] = {}
        self._parser = LogParser()
        self._pending: list[Request | Unparsed] = []  # read but not yet assigned to a window
        self._summarised: list[tuple[float, float]] = []  # windows already summarised
        self.untimed: list[Request] = []
        self._untimed_unparsed = 0
        self._late = 0  # requests of a summarised window that reached the file after it
        self._control: list[Request] = []
        self._control_lock = threading.Lock()
        # storage.client=fsspec|msc: their botocore attempts, from install_data_plane_hook
        self._hooked: list[Request] = []
        self.untimed_control: list[Request] = []
        self._warned_unparsed = False
        self._warned_lines = False

    def record_data_call(self, call: Request) -> None:
        """One attempt of a botocore-based DCP client (`hook_client`)."""
        with self._control_lock:
            self._hooked.append(call)

    def hook_client(self, events: Any) -> None:
        """Count the requests of a botocore-based DCP client (s3fs, multi-storage-client)
        whose event emitter is `events`, as the connector's log lines are counted."""
        install_data_plane_hook(events, self.record_data_call)

    def _read_new(self) -> None:
        with self._control_lock:
            self._pending.extend(self._hooked)
            self._hooked = []
        for path in sorted(p for p in self.directory.glob("*") if p.is_file()):  # hourly: by time
            offset = self._offsets.get(path.name, 0)
            with open(path, "rb") as source:
                source.seek(offset)
                data = source.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path.name] = offset + end + 1
            for line in data[:end].decode("utf-8", errors="replace").splitlines():
                item = self._parser.feed(line)
                if item is not None:
                    self._pending.append(item)

    def _settle(self, begin_wall_s: float, end_wall_s: float, settle_s: float | None = None) -> None:
        """Read until every meta request begun in [begin, end] has logged its end (at most
        settle_s): its parts and Complete are then in the file, whatever thread wrote them."""
        deadline = time.monotonic() + (self.settle_s if settle_s is None else settle_s)
        while True:
            self._read_new()
            opened = self._parser.open_spans.values()
            if not any(begin_wall_s <= at <= end_wall_s for at in opened) or time.monotonic() >= deadline:
                return
            time.sleep(_POLL_S)

    def record_control_call(self, call: Request) -> None:
        with self._control_lock:
            self._control.append(call)

    def _untimed_item(self, item: Request | Unparsed, at: float | None) -> None:
        if at is not None and any(begin <= at <= end for begin, end in self._summarised):
            self._late += 1
        if isinstance(item, Unparsed):
            self._untimed_unparsed += 1
        else:
            self.untimed.append(item)

    def window(self, begin_wall_s: float, end_wall_s: float,
               bytes_up: int | None = None, moved_bytes: int | None = None
               ) -> dict[str, Any] | None:
        """Summary of the requests whose meta request began within [begin, end]; those begun
        earlier and not yet counted go untimed, those begun after `end` stay for the next
        window (an async save's upload outlives the next save's start).

        Call right after the timed operation. `moved_bytes`: what it moved; when it moved
        some and no request was parsed, the log no longer reads as we expect: None (unknown),
        never a summary of zero requests.
        """
        self._settle(begin_wall_s, end_wall_s)
        timed: list[Request] = []
        unparsed = 0
        later: list[Request | Unparsed] = []
        for item in self._pending:
            at = item.at_s
            if at is not None and at > end_wall_s:
                later.append(item)
            elif at is None or at >= begin_wall_s:
                if isinstance(item, Unparsed):
                    unparsed += 1
                else:
                    timed.append(item)
            else:
                self._untimed_item(item, at)
        self._pending = later
        self._summarised.append((begin_wall_s, end_wall_s))
        with self._control_lock:
            control = [c for c in self._control if c.end_wall_s <= end_wall_s]
            self._control = [c for c in self._control if c.end_wall_s > end_wall_s]
        timed_control = [call for call in control if call.end_wall_s >= begin_wall_s]
        self.untimed_control += [call for call in control if call.end_wall_s < begin_wall_s]
        if unparsed:
            self._warn_lines()
        if moved_bytes and not timed and not unparsed:
            self._warn_unparsed()
            return None
        return summaries.summarize(timed, end_wall_s - begin_wall_s, bytes_up, timed_control,
                                   unparsed=unparsed)

    def error_answers(self, rank: int) -> ErrorAnswers | None:
        """The first HTTP error answer among the requests no window holds yet (those of the
        operation that just failed), or None when none was answered with an error."""
        self._settle(0.0, time.time(), FAILED_SETTLE_S)
        requests = [item for item in self._pending if isinstance(item, Request)]
        failed = [r for r in requests if r.outcome == "failed" and (r.status or 0) >= 400]
        if not failed:
            return None
        first = min(failed, key=lambda r: r.end_wall_s)
        assert first.status is not None
        of_kind = [r.status for r in requests if r.kind == first.kind]
        return ErrorAnswers(rank, first.kind, first.status, of_kind.count(first.status), len(of_kind))

    def _warn_lines(self) -> None:
        if not self._warned_lines:
            self._warned_lines = True
            log.warning("some S3 request lines of the connector's log could not be parsed in "
                        "full: they are counted as `unparsed` in the record's request "
                        "statistics, not as requests (telemetry/connector_log.py)")

    def _warn_unparsed(self) -> None:
        if self._warned_unparsed:
            return
        self._warned_unparsed = True
        if self.client != "s3torchconnector":
            log.warning(f"storage.client={self.client}: no request of its client was seen in this "
                        "rank for an operation that moved bytes (the process checkpointer's "
                        "daemon makes a save's requests, out of this rank's hooks): request "
                        "statistics are left empty (unknown), not zero; the server's own "
                        "counters (storage.metrics_url) still count them")
            return
        log.warning("no S3 request was parsed from the log of s3torchconnector "
                    f"{installed_version('s3torchconnector')} "
                    "for an operation that moved bytes: request statistics are left empty "
                    "(unknown), not zero; this release may word its request lines "
                    "differently (telemetry/connector_log.py)")

    def finish(self) -> dict[str, Any]:
        """Summary of everything outside the timed windows (call at the end of the run)."""
        self._read_new()
        for item in self._pending:
            self._untimed_item(item, item.at_s)
        self._pending = []
        with self._control_lock:
            self.untimed_control.extend(self._control)
            self._control = []
        return summaries.summarize(self.untimed, None, None, self.untimed_control,
                                   unparsed=self._untimed_unparsed, late=self._late)

    def copy_raw(self, destination: Path) -> Path | None:
        """The raw log lines (all hourly files, in order) into one file."""
        files = sorted(p for p in self.directory.glob("*") if p.is_file())  # none: no directory
        if not files:
            return None
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as out:
            for path in files:
                with open(path, "rb") as source:
                    shutil.copyfileobj(source, out)
        return destination

    def environment(self) -> dict[str, str]:
        """What the connector must see in os.environ to log into this directory."""
        return {DEBUG_LOGS_ENV: LOG_FILTER, LOGS_DIR_ENV: str(self.directory)}

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self, results_dir: str | Path, run_id: str | None, rank: int | str) -> Path | None:
        """End of the rank: keep the raw log if asked (returns where), remove the temp dir."""
        kept = None
        if self.keep_raw and run_id:
            kept = self.copy_raw(Path(results_dir) / f"{run_id}.requests" /
                                 f"rank-{int(rank):05d}.log")
        self.remove()
        return kept


def open_for_rank(rank: int | str, keep_raw: bool = False,
                  client: str = "s3torchconnector") -> RequestLog | None:
    """This rank's request log, or None when it cannot be had (warned). Call it at rank start,
    apply `log.environment()` to os.environ, and only then import s3torchconnector (its
    logger is configured once, when its native module is first imported)."""
    from dcp_fsdp.compat import connector_native_loaded

    problem = version_problem()  # the launcher refuses it; a rank started otherwise blanks
    if problem:
        log.warning(f"rank {rank}: S3 request statistics are not recorded: {problem}")
        return None
    if connector_native_loaded():
        log.warning(f"rank {rank}: s3torchconnector was imported before the request log "
                    "could be enabled; S3 request statistics are not recorded")
        return None
    # named after this process: one a killed rank left is removed by the next run (lifeline.py)
    directory = owned_tempdir(f"dcp-fsdp-requests-r{rank}-")
    return RequestLog(directory, keep_raw=keep_raw, client=client)
