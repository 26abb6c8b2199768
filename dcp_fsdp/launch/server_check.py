"""storage.metrics_url: a run's request counts checked against the S3 server's own counters
(read before the pre-flight and after the ranks; the launcher's own boto3 calls counted between),
into the run line's `server_requests` and one line. Exact only on a bucket the run has to itself.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

from dcp_fsdp import log
from dcp_fsdp.config.schema import BenchmarkConfig, StorageKind
from dcp_fsdp.config.validate import parse_s3_uri
from dcp_fsdp.launch.aftermath import replace_run_line
from dcp_fsdp.storage.s3_control import observe_clients
from dcp_fsdp.telemetry import server_counters
from dcp_fsdp.telemetry.control_plane import count_control_calls
from dcp_fsdp.telemetry.request import Request
from dcp_fsdp.telemetry.summaries import control_plane_counts


class ServerCheck:
    def __init__(self, metrics_url: str, bucket: str) -> None:
        self.metrics_url, self.bucket = metrics_url, bucket
        self.before: collections.Counter | None = None
        self._calls: list[Request] = []  # the launcher's own boto3 calls (pre-flight)

    @classmethod
    def for_run(cls, cfg: BenchmarkConfig) -> "ServerCheck | None":
        storage = cfg.storage
        if (storage.kind != StorageKind.s3 or not cfg.request_stats or not storage.metrics_url
                or not storage.uri):
            return None
        return cls(storage.metrics_url, parse_s3_uri(storage.uri)[0])

    def begin(self) -> None:
        """Before the launcher's first request to the bucket."""
        try:
            self.before = server_counters.settled_counters(self.metrics_url, self.bucket)
        except (OSError, ValueError) as error:  # URLError is an OSError
            log.warning(f"storage.metrics_url={self.metrics_url} could not be read ({error}): "
                        "the request counts are not checked against the server's")
            return
        observe_clients("server-check", functools.partial(count_control_calls,
                                                          record_call=self._calls.append))

    def end(self, record: Path | None) -> None:
        """After the ranks ended and recorded: compare, amend the run line, say it."""
        if self.before is None or record is None:
            return
        try:
            after = server_counters.settled_counters(self.metrics_url, self.bucket)
        except (OSError, ValueError) as error:
            log.warning(f"storage.metrics_url={self.metrics_url} could not be read after the "
                        f"run ({error}): the request counts are not checked")
            return
        lines = record.read_text().splitlines()
        run = json.loads(lines[0])
        samples = [row for row in map(json.loads, lines[1:]) if row.get("record") == "sample"]
        view, gaps = server_counters.record_view(samples, run.get("untimed_requests"),
                                                 control_plane_counts(self._calls))
        result = server_counters.compare(
            view, after - self.before, gaps, self.metrics_url,
            restarted=server_counters.went_back(self.before, after),
            unanswered=server_counters.unanswered_requests(samples, run.get("untimed_requests")),
            resends_unseen=(run.get("storage") or {}).get("client") in server_counters.RESENDS_UNSEEN)
        run["server_requests"] = result
        replace_run_line(record, lines, run)
        if result["match"]:
            log.info(f"requests: the record's {sum(result['server'].values())} match the server's own counters "
                     f"(storage.metrics_url)")
        else:
            differences = ", ".join(f"{k} {v:+d}" for k, v in result["differences"].items())
            log.warning("requests: the record's counts differ from the server's own counters "
                        f"(record - server: {differences or 'none'}"
                        + (f"; {'; '.join(result['incomplete'])}" if result["incomplete"] else "")
                        + f"); {self._cause_text(result)}")

    def _cause_text(self, result: dict) -> str:
        if result["cause"] == "server_restarted":
            return ("the server's counters went back during the run: it restarted (they start "
                    "at zero), so they cannot be compared with the run's")
        if result["cause"] == "unanswered_requests":
            return (f"{result['unanswered']} request(s) got no answer before the client gave "
                    "up; the server counts a request when it answers it: after this check (a "
                    "stalled server), or under a status the client never saw (its connection "
                    "broke or it timed out)")
        if result["cause"] == "resent_below_client":
            return server_counters.RESENT_BELOW_CLIENT
        return (f"another client of bucket {self.bucket} during the run would explain it, "
                "otherwise the request log was misread")
