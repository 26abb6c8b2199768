"""After a run failed, the launcher's probes of the partial checkpoint (is it complete,
its open uploads, its claim) wait at most storage.connect_timeout_s for each answer, once
(issue 31, late: on a stalled server they waited botocore's 30 s read timeout twice, 60 s
and more, after op_timeout_s had already fired). Before a run, reads keep 30 s and a retry."""

from __future__ import annotations

from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.storage import make_store


def _client_config(after_failure: bool):
    storage = StorageConfig(uri="s3://bucket/ckpt", endpoint="http://127.0.0.1:9", region="us-east-1",
                            connect_timeout_s=2.0)
    store = make_store(storage, after_failure=after_failure)
    return store.control.client().meta.config  # type: ignore[attr-defined]


def test_after_a_failure_each_probe_waits_connect_timeout_s_once(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    config = _client_config(after_failure=True)
    assert config.read_timeout == 2.0 and config.connect_timeout == 2.0
    assert config.retries["total_max_attempts"] == 1


def test_before_a_run_reads_keep_their_30_s_and_a_retry(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    config = _client_config(after_failure=False)
    assert config.read_timeout == 30 and config.retries["total_max_attempts"] == 2
