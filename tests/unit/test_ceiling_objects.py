"""Which objects the raw ceiling moves, and where (rank/ceiling.py), without a server."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_fsdp import compat
from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.plan.build import tensor_item_bytes
from dcp_fsdp.rank import ceiling
from dcp_fsdp.storage.metadata_peek import read_facts
from dcp_fsdp.storage import make_store
from dcp_fsdp.storage.layout import CEILING_ROOT
from dcp_fsdp.storage.raw import fs_ceiling_dir, s3_ceiling_prefix


def test_object_sizes_come_from_the_checkpoint_metadata(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, 3),
             "step": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=2),
             no_dist=True)
    # what rank 0 reads of .metadata: the screened facts (the run's one read of it)
    sizes = read_facts((tmp_path / ".metadata").read_bytes()).object_sizes
    on_disk = {p.name: p.stat().st_size for p in tmp_path.glob("*.distcp")}
    assert sizes == on_disk and len(on_disk) == 2
    assert ceiling.objects_by_rank(sizes, 2) == [[ceiling.RawObject(n, s) for n, s in sorted(on_disk.items())],
                                                 []]


def test_objects_are_shared_out_by_the_rank_in_their_names():
    sizes = {"__1_0.distcp": 5, "__0_1.distcp": 3, "__0_0.distcp": 2, "__10_0.distcp": 9,
             "__7_0.distcp": 1}  # rank 7 is beyond a world of 2: a different world's file
    per_rank = ceiling.objects_by_rank(sizes, 2)
    assert [[o.name for o in objs] for objs in per_rank] == [["__0_0.distcp", "__0_1.distcp"],
                                                              ["__1_0.distcp"]]


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
    assert compat.saving_rank("__1_0.distcp") == 1
    assert compat.saving_rank("0101000000/__1_3.distcp") == 1
    assert compat.saving_rank("__10_0.distcp") != 1
    assert compat.saving_rank(".metadata") != 0


def test_the_ceiling_never_lies_inside_the_checkpoints_prefix():
    assert s3_ceiling_prefix("runs/ckpt", "ab12") == "runs/ckpt.ceiling/ab12"
    assert s3_ceiling_prefix("", "ab12") == f"{CEILING_ROOT}/ab12"
    assert fs_ceiling_dir(Path("/data/ckpt"), "ab12") == Path("/data/ckpt.ceiling/ab12")
    s3 = make_store(StorageConfig(kind=StorageKind.s3, uri="s3://bucket/runs/ckpt"))
    assert s3.raw_area("ab12").location == "s3://bucket/runs/ckpt.ceiling/ab12"
    fs = make_store(StorageConfig(kind=StorageKind.fs, path="/data/ckpt"))
    assert fs.raw_area("ab12").location == "/data/ckpt.ceiling/ab12"


def test_framing_is_what_torch_save_adds():
    buffer = io.BytesIO()
    torch.save(torch.zeros(300, 7), buffer)
    assert abs(buffer.tell() - tensor_item_bytes(torch.float32, (300, 7))) <= 64


def test_fs_mover_round_trip_and_cleanup(tmp_path):
    """Through the store protocol only (raw_area): what the ceiling uses on every store."""
    store = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt"),
                                     part_size_mib=1))
    mover = ceiling.Mover(store, "tok", chunk_bytes=2**20)
    objects = [ceiling.RawObject("__0_0.distcp", 2**20 * 2 + 5), ceiling.RawObject("__0_1.distcp", 0)]
    mover.prepare(1, objects)
    client = mover.new_client()
    for obj in objects:
        mover.put(client, 1, obj)
        assert (tmp_path / "ckpt.ceiling" / "tok" / "1" / obj.name).stat().st_size == obj.size_bytes
        assert mover.get(client, 1, obj) == obj.size_bytes
    mover.remove(client, 1, objects)
    assert not (tmp_path / "ckpt.ceiling").exists()


def test_the_raw_get_reads_what_a_replicated_load_reads():
    """4 ranks as 2 replicas of 2 shards: the save spread shard 0 over ranks 0 and 2 (DCP's
    dedup), shard 1 over ranks 1 and 3. A plain load reads every shard once per replica;
    read_once only on replica 0; without replicas each rank reads what it wrote."""
    obj = ceiling.RawObject
    written = [[obj("__0_0.distcp", 4)], [obj("__1_0.distcp", 5)], [obj("__2_0.distcp", 6)], []]
    shard0 = [obj("__0_0.distcp", 4), obj("__2_0.distcp", 6)]
    shard1 = [obj("__1_0.distcp", 5)]
    assert ceiling.read_by_rank(written, 2, read_once=False) == [shard0, shard1, shard0, shard1]
    assert ceiling.read_by_rank(written, 2, read_once=True) == [shard0, shard1, [], []]
    assert ceiling.read_by_rank(written, 1, read_once=False) == written


def test_a_replicated_ceiling_refuses_a_checkpoint_saved_on_another_mesh():
    import pytest

    from dcp_fsdp.errors import UserError
    from dcp_fsdp.storage.layout import check_replicas_mirrorable

    check_replicas_mirrorable({"replicas": 2}, 2, "s")  # the same mesh: mirrored
    for manifest, said in (({"replicas": 1}, "was saved with model.replicas=1"),
                           (None, "has no manifest naming its model.replicas")):
        with pytest.raises(UserError, match=said) as refused:
            check_replicas_mirrorable(manifest, 2, "s")
        assert "drop ceiling=true" in str(refused.value)
