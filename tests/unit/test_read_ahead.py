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

from dcp_fsdp.compat import saved_tensor_view
from dcp_fsdp.storage.read_ahead import MemorySlice, range_groups
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
