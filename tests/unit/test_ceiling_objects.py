"""Which objects the raw ceiling moves, and where (rank/ceiling.py), without a server."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

from dcp_fsdp.rank import ceiling
from dcp_fsdp.storage.layout import CEILING_ROOT


def test_object_sizes_come_from_the_checkpoint_metadata(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, 3),
             "step": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=2),
             no_dist=True)
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    sizes = ceiling.sizes_from_metadata(metadata)
    on_disk = {p.name: p.stat().st_size for p in tmp_path.glob("*.distcp")}
    assert sizes == on_disk and len(on_disk) == 2
    assert ceiling.objects_of_rank(sizes, 0) == [ceiling.RawObject(n, s)
                                                 for n, s in sorted(on_disk.items())]
    assert ceiling.objects_of_rank(sizes, 1) == []


def test_planned_objects_match_what_a_save_writes(tmp_path):
    state = {f"w{i}": torch.randn(64 + i, 32) for i in range(5)}
    state["half"] = torch.randn(10, 10).to(torch.bfloat16)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=3),
             no_dist=True)
    planned = ceiling.planned_objects(state, 0, 3, "__0_")
    on_disk = sorted((p.name, p.stat().st_size) for p in tmp_path.glob("*.distcp"))
    assert [o.name for o in planned] == [name for name, _ in on_disk]
    for obj, (_, size) in zip(planned, on_disk):
        assert abs(obj.size_bytes - size) <= 64 * 6  # framing estimate, per tensor


def test_a_rank_owns_only_its_own_data_objects():
    assert ceiling.owned_by("__1_0.distcp", 1)
    assert ceiling.owned_by("0101000000/__1_3.distcp", 1)
    assert not ceiling.owned_by("__10_0.distcp", 1)
    assert not ceiling.owned_by(".metadata", 0)


def test_the_ceiling_never_lies_inside_the_checkpoints_prefix():
    assert ceiling.s3_ceiling_prefix("runs/ckpt", "ab12") == "runs/ckpt.ceiling/ab12"
    assert ceiling.s3_ceiling_prefix("", "ab12") == f"{CEILING_ROOT}/ab12"
    assert ceiling.fs_ceiling_dir(Path("/data/ckpt"), "ab12") == Path("/data/ckpt.ceiling/ab12")


def test_framing_is_what_torch_save_adds():
    framing = ceiling.torch_save_framing_bytes(torch.float32, 2)
    buffer = io.BytesIO()
    torch.save(torch.zeros(300, 7), buffer)
    assert abs(buffer.tell() - (300 * 7 * 4 + framing)) <= 64


def test_fs_mover_round_trip_and_cleanup(tmp_path):
    store = SimpleNamespace(root=tmp_path / "ckpt", config=SimpleNamespace(part_size_mib=1))
    mover = ceiling.FsMover(store, "tok")
    objects = [ceiling.RawObject("__0_0.distcp", 2**20 * 2 + 5), ceiling.RawObject("__0_1.distcp", 0)]
    mover.make_dirs(1, objects)
    for obj in objects:
        mover.put(None, 1, obj)
        assert mover.path(1, obj).stat().st_size == obj.size_bytes
        assert mover.get(None, 1, obj) == obj.size_bytes
    mover.remove(None, 1, objects)
    assert not (tmp_path / "ckpt.ceiling").exists()
