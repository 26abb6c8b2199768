"""Before any rank starts: the storage the run will use, checked in about a second.

When no S3 is configured, the embedded SeaweedFS is started on 127.0.0.1 and the
settings are pointed at it. The pre-flight (bucket, keys, endpoint, region, the
checkpoint to load) runs here, in the light parent, so bad input fails before any
rank imports torch.
"""

from __future__ import annotations

import contextlib
import os

from omegaconf import OmegaConf

from dcp_fsdp import contract, log
from dcp_fsdp.config.schema import BenchmarkConfig, Command, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.embedded_s3 import EmbeddedS3
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.storage.s3 import resolve_endpoint

EMBEDDED_BUCKET = "dcp-fsdp"


def needs_embedded_server(cfg: BenchmarkConfig) -> bool:
    return (cfg.storage.kind == StorageKind.s3 and cfg.storage.uri is None
            and resolve_endpoint(cfg.storage) is None)


@contextlib.contextmanager
def storage_environment(cfg: BenchmarkConfig):
    """Yield (cfg, extra env): the embedded server's when nothing is configured."""
    if not needs_embedded_server(cfg):
        yield cfg, {}
        return
    if cfg.command == Command.load:
        # A fresh embedded server is empty: there is nothing to load.
        raise UserError("storage.uri is not set: the embedded S3 server starts empty each run, so "
                        "there is nothing to load; use save-and-load, or point storage.uri "
                        "(and storage.endpoint) at the server that holds the checkpoint")
    server = EmbeddedS3(bucket=EMBEDDED_BUCKET)
    log.info("no S3 configured: starting the embedded SeaweedFS server on 127.0.0.1")
    endpoint = server.start()
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"storage": {
            "uri": f"s3://{endpoint.bucket}/checkpoints", "endpoint": endpoint.endpoint_url,
            "region": endpoint.region}}))
        yield cfg, {**endpoint.client_env(), contract.EMBEDDED_ENV: "1"}
    finally:
        server.stop()


def preflight(cfg: BenchmarkConfig, server_env: dict[str, str]) -> None:
    """The store answers, and (load) the checkpoint is complete; UserError otherwise."""
    with _patched_environ(server_env):
        store = make_store(cfg.storage)
        store.preflight()
        if cfg.command == Command.load:
            layout.check_loadable(store, cfg.suffix)


@contextlib.contextmanager
def _patched_environ(extra: dict[str, str]):
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
