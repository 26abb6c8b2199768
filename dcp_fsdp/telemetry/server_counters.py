"""A server's own request counters against the request counts of a record: the check from
outside that the connector-log parser counted what was really sent (docs/metrics.md "Checked
against the server": what is compared; the launcher's side: launch/server_check.py).
"""

from __future__ import annotations

import collections
import itertools
import re
import time
import urllib.request
from typing import Any, Iterable

# How SeaweedFS's SeaweedFS_s3_request_total{type} names what a client sent.
SERVER_TYPE = {
    "CreateMultipartUpload": "POST", "CompleteMultipartUpload": "POST", "UploadPart": "PUT",
    "PutObject": "PUT", "GetObject": "GET", "HeadObject": "GET", "CopyObject": "COPY",
    "UploadPartCopy": "PUT", "DeleteObject": "DELETE", "AbortMultipartUpload": "DELETE",
    "ListObjectsV2": "LIST", "ListObjects": "LIST", "ListParts": "GET", "HeadBucket": "GET",
    "DeleteObjects": "DELETE",  # a bulk delete (s3fs removes with it): one request, one count
}
SETTLE_POLL_S = 0.25  # it updates its counters just after answering
NO_STATUS = "none"  # a request's status where no answer reached the client


def server_view(by_type: dict[str, dict[str, Any]] | None = None,
                control_plane: dict[str, dict[str, int]] | None = None) -> collections.Counter:
    """What SeaweedFS should count for these requests (a summary's by_type and control_plane):
    {(server type, code): n}."""
    view: collections.Counter = collections.Counter()
    statuses = ((kind, entry.get("status") or {}) for kind, entry in (by_type or {}).items())
    for kind, per_status in itertools.chain(statuses, (control_plane or {}).items()):
        for code, n in per_status.items():
            view[(SERVER_TYPE.get(kind, kind), code)] += n
    return view


def parse_server_metrics(text: str, bucket: str | None = None) -> collections.Counter:
    """SeaweedFS_s3_request_total{bucket,code,type} from its Prometheus text: {(type, code): n}."""
    found: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if not line.startswith("SeaweedFS_s3_request_total{"):
            continue
        labels_text, _, value = line.partition("} ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
        if bucket is not None and labels.get("bucket") != bucket:
            continue
        found[(labels.get("type", "?"), labels.get("code", "?"))] += int(float(value))
    return found


def read_counters(metrics_url: str, bucket: str, timeout_s: float = 5.0) -> collections.Counter:
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:  # noqa: S310
        return parse_server_metrics(response.read().decode(), bucket)


def settled_counters(metrics_url: str, bucket: str, tries: int = 20) -> collections.Counter:
    """The counters once two reads SETTLE_POLL_S apart agree."""
    previous = read_counters(metrics_url, bucket)
    for _ in range(tries):
        time.sleep(SETTLE_POLL_S)
        current = read_counters(metrics_url, bucket)
        if current == previous:
            return current
        previous = current
    return previous


def record_view(samples: Iterable[dict[str, Any]], untimed: dict[str, Any] | None,
                launcher_calls: dict[str, dict[str, int]] | None = None
                ) -> tuple[collections.Counter, list[str]]:
    """({(server type, code): n} of what the record says was sent, why it is incomplete)."""
    view: collections.Counter = collections.Counter()
    gaps: list[str] = []
    for sample in samples:
        requests = sample.get("requests")
        if str(sample.get("op")).startswith("mem_"):
            continue  # the ceiling's DCP-alone rounds (rank/ceiling.py) ran on tmpfs: no request
        if not isinstance(requests, dict):
            gaps.append(f"{sample.get('op')} rank {sample.get('rank')}: no request counts")
            continue
        view += server_view(requests.get("by_type"), requests.get("control_plane"))
        if requests.get("unparsed"):
            gaps.append(f"{sample.get('op')} rank {sample.get('rank')}: "
                        f"{requests['unparsed']} unparsed request lines")
    if untimed is None:
        gaps.append("no untimed request counts")
    else:
        view += server_view(untimed.get("by_type"), untimed.get("control_plane"))
    view += server_view(None, launcher_calls)
    return view, gaps


# Clients that re-send a request whose connection broke below the layer the tool counts
RESENDS_UNSEEN = frozenset({"fsspec"})
RESENT_BELOW_CLIENT = (
    "storage.client=fsspec re-sends a request whose connection broke below the layer the tool "
    "counts (s3fs over aiobotocore and aiohttp), so the server counted requests the record "
    "does not hold; another client of the bucket making the same requests would look the same")


def compare(record: collections.Counter, server: collections.Counter,
            gaps: list[str], source: str, restarted: bool = False,
            unanswered: int = 0, resends_unseen: bool = False) -> dict[str, Any]:
    """The run record's `server_requests`: both views, whether they agree and, if not, the cause
    the run itself shows (each cause: docs/record-format.md; null: another client of the
    bucket, or a misread log)."""
    keys = sorted(set(record) | set(server))
    match = not gaps and all(record[k] == server[k] for k in keys)
    cause = None
    if not match and restarted:
        cause = "server_restarted"
    elif not match and unanswered and (all(record[k] >= server[k] for k in keys)
                                       or _answered_unseen(record, server)):
        cause = "unanswered_requests"
    elif not match and resends_unseen and _surplus_of_own_kinds(record, server):
        cause = "resent_below_client"
    return {
        "source": source,
        "match": match,
        "record": {" ".join(k): record[k] for k in keys if record[k]},
        "server": {" ".join(k): server[k] for k in keys if server[k]},
        "differences": {" ".join(k): record[k] - server[k] for k in keys if record[k] != server[k]},
        "incomplete": gaps,
        "cause": cause,
        "unanswered": unanswered,
    }


def _answered_unseen(record: collections.Counter, server: collections.Counter) -> bool:
    """Whether the server's surplus of each request type is at most the record's requests of
    that type with no status: answers the client never saw (and nothing else differs)."""
    surplus: collections.Counter = collections.Counter()
    for key in set(record) | set(server):
        kind, code = key
        if code == NO_STATUS:
            continue
        if server[key] < record[key]:
            return False
        surplus[kind] += server[key] - record[key]
    return all(record[(kind, NO_STATUS)] >= extra for kind, extra in surplus.items())


def _surplus_of_own_kinds(record: collections.Counter, server: collections.Counter) -> bool:
    """Whether the server has at least the record's count of everything, and more only of
    request types (method) the record holds."""
    kinds = {kind for (kind, _code), count in record.items() if count}
    return all(server[key] >= record[key] for key in record) and all(
        key[0] in kinds for key in server if server[key] > record[key])


def went_back(before: collections.Counter, after: collections.Counter) -> bool:
    """Whether any counter went down between the reads: the server restarted (counting from 0)."""
    return any(after[key] < count for key, count in before.items())


def unanswered_requests(samples: Iterable[dict[str, Any]], untimed: dict[str, Any] | None) -> int:
    """Requests the record holds that got no HTTP answer (status "none": the client gave up,
    or the connection broke), over the samples' summaries and the untimed one."""
    summaries = [sample.get("requests") for sample in samples] + [untimed]
    return sum(int((summary.get("status") or {}).get(NO_STATUS) or 0)
               for summary in summaries if isinstance(summary, dict))
