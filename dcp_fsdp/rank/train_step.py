"""A simulated training step: a fixed amount of matmul work on the rank's device.

What an async checkpoint really costs is the slowdown of the training that runs while it
uploads (staging copies, serialisation and the connector's threads compete for the CPU,
memory bandwidth and PCIe). The step is sized once, untimed (`calibrate`), so that it
takes about `step_s` with no checkpoint in flight; right before each save a few steps
give the baseline; during the upload the same steps are timed again:

    train_step_slowdown = mean step time while uploading / baseline mean - 1

The work is fixed (same matrices, same count of matmuls), so a slower step means the
device or host was busy with the checkpoint, not that the step changed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

BASELINE_STEPS = 3  # steps timed right before each save, no checkpoint in flight
_CPU_SIZE = 256  # matrix side: small enough that a step can be tens of milliseconds on CPU
_CUDA_SIZE = 4096  # large enough to keep a GPU busy per kernel
_PROBE_S = 0.2  # calibration: run matmuls for at least this long to time one


def matmuls_for(step_s: float, matmul_s: float) -> int:
    """How many matmuls of `matmul_s` seconds make one step of about `step_s` (at least 1)."""
    if matmul_s <= 0:
        return 1
    return max(1, round(step_s / matmul_s))


def slowdown(during_s: list[float], baseline_s: list[float]) -> float | None:
    """mean(during) / mean(baseline) - 1, or None without steps on either side."""
    if not during_s or not baseline_s:
        return None
    baseline = sum(baseline_s) / len(baseline_s)
    if baseline <= 0:
        return None
    return (sum(during_s) / len(during_s)) / baseline - 1


class TrainStep:
    def __init__(self, device: torch.device, step_s: float) -> None:
        self.device = device
        self.step_s = step_s
        self.matmuls = 1
        self._a = self._b = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def calibrate(self) -> None:
        """Untimed: pick the matrix size and the matmul count for one step of ~step_s."""
        size = _CUDA_SIZE if self.device.type == "cuda" else _CPU_SIZE
        generator = torch.Generator(device="cpu").manual_seed(0)
        while True:
            a = torch.rand(size, size, generator=generator).to(self.device)
            b = torch.rand(size, size, generator=generator).to(self.device)
            torch.mm(a, b)  # first call: kernel selection, allocator warm-up
            self._sync()
            count, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                count += 1
                if count % 4 == 0:
                    self._sync()
                    if time.perf_counter() - start >= _PROBE_S:
                        break
            matmul_s = (time.perf_counter() - start) / count
            # One matmul must be a small part of a step, or steps overshoot their length.
            if matmul_s <= self.step_s / 4 or size <= 64:
                break
            size = max(64, size // 2)
        self._a, self._b = a, b
        self.matmuls = matmuls_for(self.step_s, matmul_s)

    def step(self) -> float:
        """One step; its duration (device work included: synchronised on CUDA)."""
        start = time.perf_counter()
        for _ in range(self.matmuls):
            torch.mm(self._a, self._b)
        self._sync()
        return time.perf_counter() - start

    def baseline(self, steps: int = BASELINE_STEPS) -> list[float]:
        return [self.step() for _ in range(steps)]

    def run_until(self, done: Callable[[], bool]) -> list[float]:
        """Steps, back to back, until `done()` (checked between steps): their durations."""
        times = []
        while not done():
            times.append(self.step())
        return times

