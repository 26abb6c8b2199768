"""Test equipment: how SeaweedFS counts requests (its Prometheus counters), to cross-check
the request statistics we derive from the connector's log against the server's own."""

from __future__ import annotations

import collections
import re
from typing import Any

# How SeaweedFS's SeaweedFS_s3_request_total{type} names what a client sent.
SERVER_TYPE = {
    "CreateMultipartUpload": "POST", "CompleteMultipartUpload": "POST", "UploadPart": "PUT",
    "PutObject": "PUT", "GetObject": "GET", "HeadObject": "GET", "CopyObject": "COPY",
    "UploadPartCopy": "PUT", "DeleteObject": "DELETE", "AbortMultipartUpload": "DELETE",
    "ListObjectsV2": "LIST", "ListParts": "GET", "HeadBucket": "GET",
}


def server_view(by_type: dict[str, dict[str, Any]] | None = None,
                control_plane: dict[str, dict[str, int]] | None = None) -> collections.Counter:
    """What SeaweedFS should count for these requests: {(server type, code): n}.

    `by_type`: a summary's by_type (each kind's `status` counts); `control_plane`:
    boto3 calls per operation and status. SeaweedFS names HEAD as GET, UploadPart
    as PUT, Create/CompleteMultipartUpload as POST (see SERVER_TYPE).
    """
    view: collections.Counter = collections.Counter()
    for kind, entry in (by_type or {}).items():
        for code, n in (entry.get("status") or {}).items():
            view[(SERVER_TYPE.get(kind, kind), code)] += n
    for kind, per_status in (control_plane or {}).items():
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
