"""Test equipment: how SeaweedFS counts requests, now in the package (the launcher's
storage.metrics_url check uses it too): dcp_fsdp/telemetry/server_counters.py."""

from dcp_fsdp.telemetry.server_counters import (  # noqa: F401 - re-exported
    SERVER_TYPE, parse_server_metrics, server_view)
