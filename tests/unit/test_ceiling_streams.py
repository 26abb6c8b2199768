"""How many streams the raw ceiling moves a rank's objects with (rank/ceiling.py), on a real
one-rank gloo group and real files: the PUT with storage.thread_count, as DCP's writer
(one thread per object of a rank), and the GET with one, the objects in turn, as DCP's
reader reads a rank's files. Before 2026-11-25 the GET used thread_count streams too, and
load efficiency was understated exactly where tune varies thread_count."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dcp_fsdp.config.schema import BenchmarkConfig, CheckpointState, Dtype, StorageConfig, StorageKind
from dcp_fsdp.rank import ceiling, distributed

THREADS = 4


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Overlap:
    """The most calls of a method running at once."""

    def __init__(self, call) -> None:
        self.call, self.now, self.most = call, 0, 0
        self.lock = threading.Lock()

    def __call__(self, *args):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)  # long enough for parallel streams to meet
            return self.call(*args)
        finally:
            with self.lock:
                self.now -= 1


def test_the_raw_put_uses_thread_count_streams_and_the_get_one(one_rank_group, tmp_path):
    from dcp_fsdp.models.build import build_sharded_model
    from dcp_fsdp.rank.loop import CheckpointLoop
    from dcp_fsdp.models.build import dcp_state_dict
    from dcp_fsdp.storage import make_store

    storage = StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt"), thread_count=THREADS)
    cfg = BenchmarkConfig(storage=storage, iterations=1)
    sharded = build_sharded_model("tiny_llama", Dtype.fp32, CheckpointState.model,
                                  torch.device("cpu"), 1, seed=1)
    ctx = distributed.RankContext(0, 1, 0, 1, "gloo", torch.device("cpu"), node_count=1,
                                  hostnames=("host",))
    loop = CheckpointLoop(cfg, ctx, make_store(storage), sharded,
                          dcp_state_dict(sharded.model, sharded.optimizer), None,
                          lambda line: None, lambda message: None)
    raw = ceiling.Ceiling(loop)
    put, get = Overlap(raw.mover.put), Overlap(raw.mover.get)
    raw.mover.put, raw.mover.get = put, get  # type: ignore[method-assign]
    samples = raw.run()
    assert [s.op for s in samples] == ["raw_put", "raw_get", "raw_get_tensors", "raw_put_tensors"]
    fetched = samples[1].fetched_bytes
    assert fetched is not None and samples[0].bytes == samples[1].bytes == fetched > 0
    assert samples[2].fetched_bytes == fetched and samples[3].bytes == samples[0].bytes
    assert put.most == THREADS  # the planned save: thread_count objects, one stream each
    assert get.most == 1


def test_the_tensor_ceiling_lands_whole_objects_and_puts_the_live_bytes(tmp_path):
    from dcp_fsdp.storage.raw import FsRawArea

    area = FsRawArea(tmp_path, read_chunk_bytes=4)
    area.prepare(["a"])
    payload = bytes(range(10))
    area.put(None, "a", [payload])
    landing = ceiling.TensorLanding(16, torch.device("cpu"))
    assert landing.land(lambda target: area.get_into(None, "a", target)) == 10
    assert bytes(landing.hosts[0][:10].numpy()) == payload
    # the live bytes: every tensor's bytes in order, cycling where an object is larger
    state = {"w": torch.arange(4, dtype=torch.int16), "b": torch.tensor([7], dtype=torch.uint8)}
    live = ceiling.LiveBytes(state)
    stream = b"".join(bytes(c) for c in live.chunks(20, 3))
    once = torch.arange(4, dtype=torch.int16).numpy().tobytes() + bytes([7])
    assert stream == (once * 3)[:20]
    assert max(len(c) for c in live.chunks(20, 3)) == 3
