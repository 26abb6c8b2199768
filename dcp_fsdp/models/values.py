"""The checkpoint's values, a pure function of (seed, tensor name, global element index): element
g of a tensor holds the bits `HIGH[(g + kh) mod P_HIGH] | LOW[(g + kl) mod P_LOW]` (docs/reliability.md,
"Values"). Any rank computes its shard's values from its global offsets: a load is verified
bit-exactly, with no stored digests, at memory speed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

Shape = Sequence[int]  # a tensor's shape, or a shard's offset in it

# Recorded in each checkpoint's manifest: a load recomputes values only from a generator it knows.
GENERATOR = "dcp_fsdp.values/1"
P_HIGH, P_LOW = 1_048_583, 1_048_589  # distinct primes: period P_HIGH * P_LOW
# Elements per fill/check step: the largest a table slice allows (tables are padded by one
# chunk); fewer pay per-op overhead.
CHUNK = 1 << 20
assert CHUNK <= min(P_HIGH, P_LOW)
_EXPONENTS = (-9, -8, -7, -6)  # binades of the magnitudes: [2**-9, 2**-5)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps in numpy: well defined)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _layout(dtype: torch.dtype) -> tuple[int, int, int]:
    """(bits, mantissa bits, exponent bias) of a floating dtype."""
    if not dtype.is_floating_point or torch.finfo(dtype).bits not in (16, 32, 64):
        raise ValueError(f"no value layout for {dtype}")
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    exponent_bits = info.bits - 1 - mantissa
    return info.bits, mantissa, (1 << (exponent_bits - 1)) - 1


# Elements per step while building the tables: numpy temporaries of 64 KiB, below glibc's
# initial mmap threshold (128 KiB). Freeing a larger one raises glibc's dynamic threshold, and
# the tool's loads would then skip page faults a training job pays (docs/harness-cost.md).
_TABLE_STEP = 8192


def _hash_block(salt: int, start: int, stop: int) -> np.ndarray:
    return _mix64(np.arange(start, stop, dtype=np.uint64) + np.uint64(salt))


def _salt(seed: int, stream: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{GENERATOR}|{seed}|{stream}".encode(),
                                          digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=16)
def _tables(seed: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(HIGH signed, HIGH non-negative, LOW) as integer tensors on `device`, padded by CHUNK.
    Element i of HIGH / LOW comes from _hash_block(_salt(seed, "high" / "low"), 0, ...)[i]."""
    bits, mantissa, bias = _layout(dtype)
    unsigned = np.dtype(f"uint{bits}")
    view = _INT_VIEW[bits // 8]
    exponents = np.array(_EXPONENTS, dtype=np.int64)
    high = torch.empty(P_HIGH + CHUNK, dtype=view)
    high_pos = torch.empty(P_HIGH + CHUNK, dtype=view)
    low = torch.empty(P_LOW + CHUNK, dtype=view)

    def put(table: torch.Tensor, start: int, values: np.ndarray) -> None:
        table[start:start + len(values)] = torch.from_numpy(
            values.astype(unsigned).view(f"int{bits}")).view(view)

    salt = _salt(seed, "high")
    for start in range(0, P_HIGH, _TABLE_STEP):
        high_rand = _hash_block(salt, start, min(start + _TABLE_STEP, P_HIGH))
        exponent = (bias + exponents[high_rand & np.uint64(3)]).astype(np.uint64)
        positive = exponent << np.uint64(mantissa)
        put(high_pos, start, positive)
        put(high, start, positive | ((high_rand >> np.uint64(63)) << np.uint64(bits - 1)))
    salt = _salt(seed, "low")
    for start in range(0, P_LOW, _TABLE_STEP):
        put(low, start, _hash_block(salt, start, min(start + _TABLE_STEP, P_LOW))
            & np.uint64((1 << mantissa) - 1))
    for table, period in ((high, P_HIGH), (high_pos, P_HIGH), (low, P_LOW)):
        table[period:].copy_(table[:CHUNK])  # padding: a chunk may wrap the table once
    return high.to(device), high_pos.to(device), low.to(device)


def runs(global_shape: Shape, local_shape: Shape,
         global_offset: Shape) -> Iterator[tuple[int, int, int]]:
    """(local flat start, global flat start, length) of the contiguous runs of a block shard."""
    global_shape, local_shape = tuple(global_shape), tuple(local_shape)
    if math.prod(local_shape) == 0:
        return
    ndim = len(global_shape)
    # Trailing dims held whole: together with the last partial dim they form one run.
    first_whole = ndim
    while first_whole > 0 and local_shape[first_whole - 1] == global_shape[first_whole - 1]:
        first_whole -= 1
    if first_whole == 0:
        yield 0, 0, math.prod(local_shape)
        return
    strides = [math.prod(global_shape[d + 1:]) for d in range(ndim)]
    partial = first_whole - 1
    length = local_shape[partial] * strides[partial]
    base = global_offset[partial] * strides[partial]
    for n, outer in enumerate(np.ndindex(*local_shape[:partial])):
        start = base + sum((global_offset[d] + i) * strides[d] for d, i in enumerate(outer))
        yield n * length, start, length


def _chunks(seed: int, key: str, dtype: torch.dtype, device: torch.device, global_shape: Shape,
            local_shape: Shape, global_offset: Shape) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(local flat start, HIGH slice, LOW slice) per chunk of the shard, in order."""
    signed, high_pos, low = _tables(seed, dtype, device)
    # non-negative where the meaning requires it: AdamW's second moment and step count
    high = high_pos if key.endswith(("exp_avg_sq", "max_exp_avg_sq", ".step")) else signed
    # where tensor `key` starts in the HIGH and LOW sequences
    digest = hashlib.blake2b(f"{GENERATOR}|{seed}|{key}".encode(), digest_size=16).digest()
    kh = int.from_bytes(digest[:8], "little") % P_HIGH
    kl = int.from_bytes(digest[8:], "little") % P_LOW
    for local_start, global_start, length in runs(global_shape, local_shape, global_offset):
        for pos in range(0, length, CHUNK):
            n = min(CHUNK, length - pos)
            g = global_start + pos
            h, lo = (g + kh) % P_HIGH, (g + kl) % P_LOW
            yield local_start + pos, high[h:h + n], low[lo:lo + n]


def fill(local: torch.Tensor, seed: int, key: str, global_shape: Shape,
         global_offset: Shape) -> None:
    """Write tensor `key`'s values into `local`, the block at `global_offset` of the whole."""
    target = local if local.is_contiguous() else torch.empty_like(local, memory_format=torch.contiguous_format)
    flat = target.view(-1).view(_INT_VIEW[local.element_size()])
    for start, high, low in _chunks(seed, key, local.dtype, local.device, global_shape,
                                    local.shape, global_offset):
        torch.bitwise_or(high, low, out=flat[start:start + high.numel()])
    if target is not local:
        local.copy_(target)


@functools.lru_cache(maxsize=1)
def _memcmp() -> Callable[[int, int, int], int] | None:
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


@functools.lru_cache(maxsize=8)
def _scratch(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One chunk of expected values, reused: a fresh one per tensor would page-fault anew."""
    return torch.empty(CHUNK, dtype=dtype, device=device)


def first_mismatch(local: torch.Tensor, seed: int, key: str, global_shape: Shape,
                   global_offset: Shape) -> tuple[int, ...] | None:
    """Global index of the first element of `local` that differs from its value, or None.
    Compares bits (NaN-safe): memcmp on a CPU (torch.equal is ~3x slower there)."""
    data = local if local.is_contiguous() else local.contiguous()
    flat = data.view(-1).view(_INT_VIEW[local.element_size()])
    memcmp = _memcmp() if local.device.type == "cpu" else None
    buffer = _scratch(flat.dtype, local.device)
    for start, high, low in _chunks(seed, key, local.dtype, local.device, global_shape,
                                    local.shape, global_offset):
        n = high.numel()
        want = torch.bitwise_or(high, low, out=buffer[:n])
        got = flat[start:start + n]
        same = (torch.equal(got, want) if memcmp is None
                else memcmp(got.data_ptr(), want.data_ptr(), n * flat.element_size()) == 0)
        if not same:
            local_index = start + int((got != want).nonzero()[0])
            local_pos = np.unravel_index(local_index, tuple(local.shape)) if local.dim() else ()
            return tuple(int(o) + int(i) for o, i in zip(global_offset, local_pos))
    return None
