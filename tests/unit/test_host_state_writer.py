"""A CPU rank's writer never asks CUDA for a stream (storage/base.py HOST_STATE_WRITER_KWARGS).
DCP's writers choose their loader by the machine: with CUDA available and one thread they
overlap device-to-host copies on torch.cuda.current_stream(), which opened a CUDA context on
GPU 0 in each gloo rank of the lent H100 (tests/gpu: test_gloo_ranks_on_a_gpu_host_open_no_
cuda_context). Here CUDA is made to look available and its stream refused: DCP's own save
shows which writers would open one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_fsdp.config.schema import StorageClient, StorageConfig, StorageKind
from dcp_fsdp.storage import make_store
from dcp_fsdp.storage.base import HOST_STATE_WRITER_KWARGS


class AskedForAStream(Exception):
    pass


@pytest.fixture
def cuda_looks_available(monkeypatch):
    def refuse(*args, **kwargs):
        raise AskedForAStream("torch.cuda.current_stream()")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", refuse)


def test_a_host_state_save_never_asks_cuda_for_a_stream(tmp_path, cuda_looks_available):
    store = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path)))
    state = {"weight": torch.arange(16, dtype=torch.float32)}
    dcp.save(state, storage_writer=store.writer("host", host_state=True), no_dist=True)
    loaded = {"weight": torch.zeros(16)}
    dcp.load(loaded, storage_reader=store.reader("host"), no_dist=True)
    assert torch.equal(loaded["weight"], state["weight"])
    # the premise: torch's default writer on such a machine asks for one (DCP wraps the error)
    with pytest.raises(CheckpointException, match="AskedForAStream"):
        dcp.save(state, storage_writer=store.writer("device"), no_dist=True)


@pytest.mark.parametrize("client", [StorageClient.s3torchconnector, StorageClient.fsspec])
def test_every_s3_clients_writer_takes_the_host_state_setting(client):
    store = make_store(StorageConfig(kind=StorageKind.s3, uri="s3://bucket/ckpt", client=client,
                                     region="us-east-1", endpoint="http://127.0.0.1:9"))
    assert store.writer("s", host_state=True).per_thread_copy_ahead == 0
    assert store.writer("s").per_thread_copy_ahead != 0
    assert HOST_STATE_WRITER_KWARGS == {"per_thread_copy_ahead": 0}
