"""GetObject bodies that break mid-stream, for the botocore-based clients (s3fs over
aiobotocore, multi-storage-client over boto3; telemetry/control_plane.py).

botocore's events see an attempt when its status and headers arrive: a GET whose body is cut
after that fails later, in the body's read, and the client sends it again by itself; to the
events both attempts were whole. So the hook hands each GET's body out through a counting
body of the same kind (`counted_body`): a read that raises marks the attempt `broken`, with
the body bytes that came down before the cut as `received` (exact for aiohttp's count; a
floor for urllib3, whose failed whole read loses what it had got: `body_known` False). Bytes
the kernel dropped with the reset reach no client: the wire meters count them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from botocore.response import StreamingBody

from dcp_fsdp.telemetry.request import Request


class BodyCount:
    """What one GET's body delivered, and the attempt it belongs to."""

    def __init__(self, call: Request, on_break: Callable[[Request], None],
                 wire_bytes: Callable[[], int | None]) -> None:
        self.call, self._on_break, self._wire_bytes = call, on_break, wire_bytes
        self.delivered = 0

    def broke(self, whole_read: bool) -> None:
        """A read raised: the attempt failed mid-body (once; a later read of the same broken
        body changes nothing)."""
        if self.call.broken:
            return
        wire = self._wire_bytes()
        self.call.broken, self.call.outcome, self.call.retryable = True, "failed", True
        self.call.received = max(self.delivered, wire or 0)
        self.call.body_known = wire is not None or not whole_read
        self._on_break(self.call)


class CountedBody(StreamingBody):
    """A botocore StreamingBody that reads through another (the one botocore made) and
    counts what it delivers; its content length is checked by that one."""

    def __init__(self, body: StreamingBody, count: BodyCount) -> None:
        super().__init__(body, None)
        self._body, self._count = body, count

    def read(self, amt: int | None = None) -> bytes:
        try:
            chunk = self._body.read(amt)
        except Exception:
            self._count.broke(whole_read=amt is None or amt < 0)
            raise
        self._count.delivered += len(chunk)
        return chunk

    def readinto(self, b: Any) -> int:
        try:
            amount = self._body.readinto(b)
        except Exception:
            self._count.broke(whole_read=False)
            raise
        self._count.delivered += amount
        return amount

    def set_socket_timeout(self, timeout: float) -> None:
        self._body.set_socket_timeout(timeout)


@functools.cache
def counted_aio_body_class() -> type:
    """The same for aiobotocore's async bodies (s3fs); made on first use: only an fsspec rank
    imports aiobotocore."""
    from aiobotocore.response import AioStreamingBodyBase

    class CountedAioBody(AioStreamingBodyBase):
        def __init__(self, body: Any, count: BodyCount) -> None:
            super().__init__(body, None)  # its content length is checked by `body`
            self._body, self._count = body, count

        async def read(self, amt: int | None = None) -> bytes:
            try:
                chunk: bytes = await self._body.read(amt)
            except Exception:
                self._count.broke(whole_read=amt is None or amt < 0)
                raise
            self._count.delivered += len(chunk)
            return chunk

        async def readinto(self, b: Any) -> int:
            try:
                amount: int = await self._body.readinto(b)
            except Exception:
                self._count.broke(whole_read=False)
                raise
            self._count.delivered += amount
            return amount

        async def aclose(self) -> None:
            await self._body.aclose()

    return CountedAioBody


def counted_body(body: Any, count: BodyCount) -> Any:
    """`body` read through a counter, of its kind (sync or async); an unknown kind as is."""
    if inspect.iscoroutinefunction(getattr(body, "read", None)):
        return counted_aio_body_class()(body, count)
    if isinstance(body, StreamingBody):
        return CountedBody(body, count)
    return body


def note_response_socket(http_response: Any) -> None:
    """Name the socket a GET's answer came on to the wire meters (process/wire_meter.py) while
    it is open: a connection cut mid-body and closed at once still counts to its last byte."""
    connection = getattr(getattr(http_response, "raw", None), "connection", None)
    sock = getattr(connection, "sock", None)  # urllib3
    transport = getattr(connection, "transport", None)  # aiohttp
    if sock is None and transport is not None:
        sock = transport.get_extra_info("socket")
    fileno = getattr(sock, "fileno", None)
    if fileno is None:
        return
    from dcp_fsdp.process.wire_meter import note_socket

    try:
        note_socket(fileno())
    except (OSError, ValueError):
        pass  # closed meanwhile: the meters' scans had their chance


def aiohttp_body_bytes(http_response: Any) -> Callable[[], int | None]:
    """The body bytes aiohttp took off the socket for this response (None: unknown)."""
    content = getattr(getattr(http_response, "raw", None), "content", None)

    def wire_bytes() -> int | None:
        total = getattr(content, "total_raw_bytes", None)
        return total if isinstance(total, int) else None

    return wire_bytes
