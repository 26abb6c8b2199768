"""The tool's reader (storage/read_ahead.py): its range groups, its tensor views of the
fetched bytes, and a DCP load through it in this process, bit for bit and within its stated
memory bound (files on tmp_path: no server, no ranks)."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_fsdp.compat import saved_tensor_layout, saved_tensor_view
from dcp_fsdp.storage.read_ahead import (FRAMING_BYTES, ItemFraming, MemorySlice, OutsideFraming,
                                         lands_in_place, range_groups, tensor_bytes)
from dcp_fsdp.storage.timed_dcp import TimedLoadPlanner, TimedReadAheadFileSystemReader
from dcp_fsdp.storage.timeline import HookTimeline


def item(index: int) -> Any:
    return SimpleNamespace(storage_index=index)  # what range_groups reads of a ReadItem


def test_items_that_touch_are_one_range_up_to_the_cap():
    info = {0: SimpleNamespace(relative_path="a", offset=0, length=10),
            1: SimpleNamespace(relative_path="a", offset=10, length=10),
            2: SimpleNamespace(relative_path="a", offset=20, length=30),  # over the cap: new
            3: SimpleNamespace(relative_path="a", offset=60, length=5),  # a gap: new
            4: SimpleNamespace(relative_path="b", offset=0, length=5)}
    groups = range_groups([item(4), item(3), item(2), item(1), item(0)], info, group_bytes=25)
    assert [(g.relative_path, g.start, g.end, [i.storage_index for i in g.items])
            for g in groups] == [("b", 0, 5, [4]), ("a", 0, 20, [0, 1]), ("a", 20, 50, [2]),
                                 ("a", 60, 65, [3])]


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.randn(64, 48).to(torch.bfloat16)[:, 7:40],  # a view: strides and an offset
    torch.tensor(3.5, dtype=torch.float64),  # a scalar (AdamW's step)
    torch.empty(0, 5),
])
def test_a_saved_tensor_is_read_where_it_lies(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    data = bytearray(b"xyz" + buffer.getvalue())  # not at offset 0 of its buffer
    view = saved_tensor_view(memoryview(data)[3:], MemorySlice)
    assert view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_a_load_through_the_tool_s_reader_is_bit_exact_and_within_its_bound(tmp_path):
    state: dict[str, Any] = {f"layer{i}.weight": torch.randn(256, 64 + i) for i in range(12)}
    state["step"] = torch.tensor(7.0)
    state["extra"] = {"note": io.BytesIO(b"bytes item")}  # a BYTE_IO item
    dcp.save(state, checkpoint_id=str(tmp_path))
    target: dict[str, Any] = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
              for k, v in state.items()}
    target["extra"] = {"note": io.BytesIO()}
    timeline = HookTimeline()
    group_bytes, read_ahead = 100_000, 3
    reader = TimedReadAheadFileSystemReader(str(tmp_path), timeline=timeline,
                                            read_ahead=read_ahead, group_bytes=group_bytes)
    dcp.load(target, storage_reader=reader, planner=TimedLoadPlanner(timeline))
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key], value), key
    assert target["extra"]["note"].getvalue() == b"bytes item"
    largest_item = max(v.numel() * v.element_size() for v in state.values()
                       if isinstance(v, torch.Tensor)) + 4096  # torch.save's framing
    peak = timeline.read_ahead_peak_bytes
    assert peak is not None and 0 < peak <= read_ahead * max(group_bytes, largest_item)
    assert timeline.moved.total > 0 and timeline.target_copy_s is not None


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_an_item_s_layout_comes_from_its_framing_alone():
    """torch.load to the meta device reads the first and last few KiB of an item, never its
    data: the framing file serves those and refuses the rest."""
    tensor = torch.randn(512, 256)
    data = saved(tensor)
    framing = ItemFraming(data[:FRAMING_BYTES], data[-FRAMING_BYTES:], len(data))
    meta, offset = saved_tensor_layout(lambda: ItemFraming(data[:FRAMING_BYTES],
                                                            data[-FRAMING_BYTES:], len(data)))
    assert meta.device.type == "meta" and meta.shape == tensor.shape and meta.dtype == tensor.dtype
    landed = torch.empty_like(tensor)
    tensor_bytes(landed)[:] = data[offset:offset + tensor.numel() * tensor.element_size()]
    assert torch.equal(landed, tensor)
    framing.seek(len(data) // 2)
    with pytest.raises(OutsideFraming):
        framing.read(16)


def read(lengths: list[int], offsets: list[int] | None = None) -> Any:
    return SimpleNamespace(lengths=lengths, storage_offsets=offsets or [0] * len(lengths))


@pytest.mark.parametrize(("saved_tensor", "target", "req", "lands"), [
    (torch.zeros(8, 4), torch.empty(8, 4), read([8, 4]), True),
    (torch.zeros(8, 4), torch.empty(4, 4), read([4, 4], [4, 0]), False),  # narrowed
    (torch.zeros(8, 4), torch.empty(8, 4, dtype=torch.bfloat16), read([8, 4]), False),  # dtype
    (torch.zeros(4, 8).t(), torch.empty(8, 4), read([8, 4]), False),  # saved strided
    (torch.zeros(8, 4), torch.empty(4, 8).t(), read([8, 4]), False),  # target strided
    (torch.zeros(0, 4), torch.empty(0, 4), read([0, 4]), False),  # nothing to land
])
def test_only_a_whole_dense_item_of_the_target_s_dtype_lands_in_place(saved_tensor, target, req,
                                                                      lands):
    meta = torch.load(io.BytesIO(saved(saved_tensor)), map_location="meta", weights_only=True)
    assert lands_in_place(meta, target, req) is lands


def test_a_load_that_cannot_land_is_copied_bit_exact(tmp_path):
    """Strided, narrowed-away and other-dtype items through the landing reader: each falls
    back to a whole read and a copy, bit for bit."""
    state: dict[str, Any] = {"strided": torch.randn(64, 300).t(), "plain": torch.randn(300, 64),
                             "cast": torch.randn(128, 64)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    target: dict[str, Any] = {"strided": torch.zeros(300, 64), "plain": torch.zeros(300, 64),
                              "cast": torch.zeros(128, 64, dtype=torch.float64)}
    timeline = HookTimeline()
    reader = TimedReadAheadFileSystemReader(str(tmp_path), timeline=timeline, read_ahead=2,
                                            group_bytes=2**20)
    dcp.load(target, storage_reader=reader, planner=TimedLoadPlanner(timeline))
    assert torch.equal(target["strided"], state["strided"])
    assert torch.equal(target["plain"], state["plain"])
    assert torch.equal(target["cast"], state["cast"].double())
    assert timeline.target_copy_by_reader and (timeline.target_copy_s or 0) > 0
