"""The value function: what a shard holds depends on (seed, name, global index) only."""

from __future__ import annotations

import math

import pytest
import torch

from dcp_fsdp.models import values


def expected(seed: int, key: str, dtype: torch.dtype, global_shape: values.Shape,
             local_shape: values.Shape | None = None,
             global_offset: values.Shape | None = None) -> torch.Tensor:
    """The values a shard must hold (a new tensor)."""
    local_shape = tuple(global_shape) if local_shape is None else tuple(local_shape)
    global_offset = (0,) * len(local_shape) if global_offset is None else global_offset
    out = torch.empty(local_shape, dtype=dtype)
    values.fill(out, seed, key, global_shape, global_offset)
    return out


def split_dim0(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of each part, uneven like a real split (e.g. 10 -> 4, 3, 3)."""
    bounds = torch.tensor_split(torch.arange(size), parts)
    return [(int(b[0]), len(b)) for b in bounds if len(b)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [2, 3])
def test_same_values_whatever_the_sharding(dtype, parts):
    shape = (11, 7, 5)
    whole = expected(3, "model.layers.0.w", dtype, shape)
    for offset, length in split_dim0(shape[0], parts):
        shard = expected(3, "model.layers.0.w", dtype, shape, (length, *shape[1:]),
                                (offset, 0, 0))
        assert torch.equal(bits(shard), bits(whole[offset:offset + length]))
        assert values.first_mismatch(shard, 3, "model.layers.0.w", shape, (offset, 0, 0)) is None


def test_blocks_along_other_dims_and_across_chunks():
    # a shard along dim 1, a 2-D block, and a tensor longer than one chunk split off-chunk
    shape = (6, 9, 4)
    whole = expected(1, "k", torch.bfloat16, shape)
    assert torch.equal(expected(1, "k", torch.bfloat16, shape, (6, 4, 4), (0, 5, 0)),
                       whole[:, 5:9])
    assert torch.equal(expected(1, "k", torch.bfloat16, shape, (3, 2, 3), (2, 6, 1)),
                       whole[2:5, 6:8, 1:4])
    long = (values.CHUNK * 2 + 12_345,)
    whole = expected(1, "long", torch.bfloat16, long)
    cut = values.CHUNK // 3 + 1
    tail = expected(1, "long", torch.bfloat16, long, (long[0] - cut,), (cut,))
    assert torch.equal(bits(tail), bits(whole[cut:]))


def test_runs_of_a_block_shard_are_contiguous_global_ranges():
    assert list(values.runs((10, 4), (5, 4), (5, 0))) == [(0, 20, 20)]
    assert list(values.runs((3, 4), (3, 2), (0, 1))) == [(0, 1, 2), (2, 5, 2), (4, 9, 2)]
    assert list(values.runs((), (), ())) == [(0, 0, 1)]
    assert list(values.runs((0, 4), (0, 4), (0, 0))) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_look_like_small_weights(dtype):
    weights = expected(0, "model.w", dtype, (256, 256)).float()
    assert torch.isfinite(weights).all()
    assert weights.abs().min() >= 2**-9 and weights.abs().max() < 2**-5
    assert 0.4 < (weights < 0).float().mean() < 0.6
    # AdamW's second moment and step count must be >= 0
    assert (expected(0, "optim.state.w.exp_avg_sq", dtype, (4096,)) > 0).all()
    assert expected(0, "optim.state.w.step", torch.float32, ()) > 0


def test_name_and_seed_change_the_values():
    a = expected(0, "model.a", torch.bfloat16, (4096,))
    assert not torch.equal(a, expected(0, "model.b", torch.bfloat16, (4096,)))
    assert not torch.equal(a, expected(1, "model.a", torch.bfloat16, (4096,)))
    assert torch.equal(a, expected(0, "model.a", torch.bfloat16, (4096,)))
    # no short period: the second half of a long tensor is not a repeat of the first
    long = expected(0, "model.a", torch.bfloat16, (2 * values.P_HIGH,))
    assert not torch.equal(long[:values.P_HIGH], long[values.P_HIGH:])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_flipped_bit_is_found_at_its_global_index(where):
    shape = (values.CHUNK // 512 + 3, 512)  # spans two chunks
    offset = (5, 0)
    local_shape = (shape[0] - 5, 512)
    shard = expected(2, "model.w", torch.bfloat16, shape, local_shape, offset)
    index = {"first": (0, 0), "middle": (local_shape[0] // 2, 77),
             "last": (local_shape[0] - 1, 511)}[where]
    bits(shard)[index] ^= 1  # the lowest mantissa bit: the smallest possible change
    assert values.first_mismatch(shard, 2, "model.w", shape, offset) == (index[0] + 5, index[1])
    assert values.first_mismatch(shard, 2, "model.other", shape, offset) == (5, 0)


def test_negative_zero_and_nan_are_compared_as_bits():
    shard = expected(0, "k", torch.float32, (8,))
    shard[3] = float("nan")
    assert values.first_mismatch(shard, 0, "k", (8,), (0,)) == (3,)
    zero = torch.zeros(4)
    assert values.first_mismatch(zero, 0, "k", (4,), (0,)) == (0,)


def test_non_contiguous_shards_are_filled_and_checked():
    base = torch.empty(8, 6, dtype=torch.bfloat16)
    view = base.t()  # (6, 8), not contiguous
    values.fill(view, 4, "k", (6, 8), (0, 0))
    assert torch.equal(view, expected(4, "k", torch.bfloat16, (6, 8)))
    assert values.first_mismatch(view, 4, "k", (6, 8), (0, 0)) is None


def test_period_is_the_product_of_coprime_table_lengths():
    assert math.gcd(values.P_HIGH, values.P_LOW) == 1
    assert values.CHUNK <= min(values.P_HIGH, values.P_LOW)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tables_are_the_hash_streams(dtype):
    """Built in steps, the tables still hold element i of each hash stream at index i."""
    high, high_pos, low = values._tables(7, dtype, torch.device("cpu"))
    bits_, mantissa, _ = values._layout(dtype)
    stream = values._hash_block(values._salt(7, "low"), 0, values.P_LOW)
    want_low = torch.from_numpy((stream & ((1 << mantissa) - 1)).astype(f"int{bits_}"))
    assert torch.equal(low[:values.P_LOW], want_low.view(low.dtype))
    assert torch.equal(low[values.P_LOW:], low[:values.CHUNK])  # the padding wraps
    sign = torch.from_numpy((values._hash_block(values._salt(7, "high"), 0, 4) >> 63).astype("int64"))
    negative = (high[:4].to(torch.int64) < 0).to(torch.int64)
    assert torch.equal(negative, sign) and bool((high_pos >= 0).all())


FAULTS_AFTER_TABLES = """
import resource, sys, torch
from dcp_fsdp.models import values
values._tables(0, torch.bfloat16, torch.device("cpu"))
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
size = 4 << 20  # a shard-sized temporary, as torch.load makes one per tensor in dcp.load
for _ in range(2):
    before = faults()
    torch.empty(size, dtype=torch.uint8).fill_(1)
print(faults() - before, size // 4096)
"""
