"""One request, as the request log parses it from the connector's log and the botocore hooks
(`control_plane.py`) record it; a module of its own so that those import it, not each other."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Request:
    """One HTTP attempt the connector made (or a control-plane call, kind prefixed)."""

    end_wall_s: float  # when it ended (log timestamp), epoch seconds
    kind: str  # CreateMultipartUpload, UploadPart, GetObject, HeadObject, DeleteObject, ...
    outcome: str  # ok | miss | failed | canceled
    status: int | None  # HTTP status; None when no response arrived
    duration_s: float | None
    ttfb_s: float | None = None
    # GetObject: bytes in the requested range; PutObject / UploadPart (botocore's hook): its body's
    nbytes: int | None = None
    retryable: bool = False
    retried: bool = False
    key: str | None = None
    # when its meta request began (the connector's "new request" line, written by the
    # calling thread inside the operation): which operation the request belongs to
    opened_wall_s: float | None = None
    # its status came (2xx) but the transfer broke (a crt_error): failed, its body in part (<= nbytes)
    broken: bool = False
    # a broken GET of a botocore-based client (telemetry/get_bodies.py): the body bytes known
    # to have come down before the break, and whether they are all that came (else a floor)
    received: int | None = None
    body_known: bool = False

    @property
    def at_s(self) -> float:
        return self.end_wall_s if self.opened_wall_s is None else self.opened_wall_s

    @property
    def throttled(self) -> bool:
        return self.outcome == "failed" and self.status in (429, 503)
