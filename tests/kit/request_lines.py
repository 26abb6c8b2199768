"""Connector request-log lines parsed whole (the package parses them as a rank's log grows:
telemetry/request_log.RequestLog)."""

from __future__ import annotations

from typing import Iterable

from dcp_fsdp.telemetry.connector_log import LogParser, Request, Unparsed


def parse_lines(lines: Iterable[str]) -> list[Request]:
    """The requests of these lines (unparsed ones left out: `parse_all` keeps them)."""
    return [r for r in parse_all(lines) if isinstance(r, Request)]


def parse_all(lines: Iterable[str]) -> list[Request | Unparsed]:
    parser = LogParser()
    return [r for r in (parser.feed(line) for line in lines) if r is not None]
