"""A simulated training step: a fixed amount of work (matmuls, or memory-bound vector adds) on the
rank's device, sized once (`calibrate`) to take about `step_s` with no checkpoint in flight, timed
before each save (the baseline) and during its upload (`slowdown`: train_step_slowdown). A step's
compute time excludes its wait for staging before its update (the stall: StepTimes.wait_s): its
forward/backward may overlap staging, its weight update may not. Work kinds: docs/async.md.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from dcp_fsdp.config.schema import TrainStepWork

BASELINE_STEPS = 5  # steps timed right before each save (3 were too few on a loaded machine)
# The operands' first size per (work, on CUDA): matmul, a matrix side small enough that a step
# can be tens of milliseconds on CPU, large enough to keep a GPU busy per kernel; memory, the
# elements of each of three vectors, well beyond the last-level cache (32, 256 MiB of fp32).
_FIRST_SIZE = {(TrainStepWork.matmul, False): 256, (TrainStepWork.matmul, True): 4096,
               (TrainStepWork.memory, False): 2**23, (TrainStepWork.memory, True): 2**26}
_SMALLEST = {TrainStepWork.matmul: 64, TrainStepWork.memory: 2**16}
_PROBE_S = 0.2  # calibration: run matmuls for at least this long to time one


class StepTimes(NamedTuple):
    """Steps run back to back: each one's compute time (less its wait for staging), all the waits."""

    compute_s: list[float]
    wait_s: float


def matmuls_for(step_s: float, matmul_s: float) -> int:
    """Operations (matmuls or vector adds) of `matmul_s` seconds in a step of ~`step_s` (at least 1)."""
    if matmul_s <= 0:
        return 1
    return max(1, round(step_s / matmul_s))


def slowdown(during_s: list[float], baseline_s: list[float]) -> float | None:
    """mean(during) / mean(baseline) - 1, or None without steps on either side."""
    baseline = sum(baseline_s) / len(baseline_s) if baseline_s else 0.0
    if not during_s or baseline <= 0:
        return None
    return (sum(during_s) / len(during_s)) / baseline - 1


class TrainStep:
    def __init__(self, device: torch.device, step_s: float,
                 work: TrainStepWork = TrainStepWork.matmul) -> None:
        self.device = device
        self.step_s = step_s
        self.work = work
        self.matmuls = 1  # operations per step (matmuls, or vector adds)
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        self._out: torch.Tensor | None = None  # memory work: the sum's destination
        self.stall_wait_s = 0.0  # the last step's wait before its update (staging)

    def _sync(self) -> None:
        """Wait for the work this step queued: an event on the current stream, which the
        step's kernels run on. Not torch.cuda.synchronize: that also waits for an async
        save's staging copies on the stager's stream, and would count them as compute."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()

    def _operands(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.work == TrainStepWork.memory:  # the values do not matter, only their bytes
            a = torch.full((size,), 1.0, device=self.device)
            return a, torch.full_like(a, 2.0), torch.empty_like(a)
        generator = torch.Generator(device="cpu").manual_seed(0)
        return (torch.rand(size, size, generator=generator).to(self.device),
                torch.rand(size, size, generator=generator).to(self.device), None)

    def _operate(self) -> None:
        """One operation of the step's work."""
        a, b = self._a, self._b
        if a is None or b is None:
            raise RuntimeError("TrainStep.step() before calibrate()")
        if self._out is not None:
            torch.add(a, b, out=self._out)
        else:
            torch.mm(a, b)

    def calibrate(self) -> None:
        """Untimed: pick the operands' size and the operation count for one step of ~step_s."""
        size, smallest = _FIRST_SIZE[self.work, self.device.type == "cuda"], _SMALLEST[self.work]
        while True:
            self._a, self._b, self._out = self._operands(size)
            self._operate()  # first call: kernel selection, allocator warm-up
            self._sync()
            count, start = 0, time.perf_counter()
            while True:
                self._operate()
                count += 1
                if count % 4 == 0:
                    self._sync()
                    if time.perf_counter() - start >= _PROBE_S:
                        break
            operation_s = (time.perf_counter() - start) / count
            # One operation must be a small part of a step, or steps overshoot their length.
            if operation_s <= self.step_s / 4 or size <= smallest:
                break
            size = max(smallest, size // 2)
        self.matmuls = matmuls_for(self.step_s, operation_s)

    def step(self, before_update: Callable[[], object] | None = None) -> float:
        """One step's duration (device work included). `before_update` (it blocks until staging is
        done) runs between the forward/backward and the update; its time goes to `stall_wait_s`."""
        start = time.perf_counter()
        self.stall_wait_s = 0.0
        for _ in range(self.matmuls):
            self._operate()
        self._sync()
        if before_update is not None:
            waited = time.perf_counter()
            before_update()
            self.stall_wait_s = time.perf_counter() - waited
        return time.perf_counter() - start

    def baseline(self, steps: int = BASELINE_STEPS) -> list[float]:
        return [self.step() for _ in range(steps)]

    def run_until(self, done: Callable[[], bool],
                  before_update: Callable[[], object] | None = None) -> StepTimes:
        """Steps back to back until `done()` (checked between steps); the first waits on `before_update`."""
        compute, waited = [], 0.0
        while not done():
            compute.append(self.step(before_update) - self.stall_wait_s)
            waited += self.stall_wait_s
            before_update = None
        return StepTimes(compute, waited)

    def run(self, count: int, before_update: Callable[[], object] | None = None) -> StepTimes:
        """`count` steps (the training between two saves) as run_until, whatever the upload does."""
        steps = iter(range(count))
        return self.run_until(lambda: next(steps, None) is None, before_update)
