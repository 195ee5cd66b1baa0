"""The benchmark clock: warm-up steps, then the timed steps between two waits for all the work queued."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepClock:
    """Steps 0..warm-1 warm up; the clock runs from a synchronized start of step `warm` to a synchronized end of the
    last step, so the lagged optimizer step of the last step is inside it."""

    def __init__(self, warm: int, iters: int, synchronize: Callable[[], None]) -> None:
        self.warm, self.iters, self.synchronize = warm, iters, synchronize
        self.start = self.stop = None
        self.step_s: list[float] = []  # unsynchronized wall time of every step (informational)
        self._tick = 0.0

    def begin(self, step: int) -> None:
        if step == self.warm:
            self.synchronize()
            self.start = time.perf_counter()
        self._tick = time.perf_counter()

    def end(self, step: int) -> None:
        self.step_s.append(round(time.perf_counter() - self._tick, 4))
        if step == self.warm + self.iters - 1:
            self.synchronize()
            self.stop = time.perf_counter()

    def iter_s(self) -> float:
        if self.start is None or self.stop is None:
            raise RuntimeError(f"the timed steps did not all run (ran {len(self.step_s)} of "
                               f"{self.warm + self.iters} steps)")
        return (self.stop - self.start) / self.iters


def engine_waiter(get_engine: Callable, cuda_indices: list[int]) -> Callable[[], None]:
    """Wait for every task and optimizer step of the engine `get_engine()` returns, then for the devices.

    Without a look (`wait_for_work`, not `synchronize`): a look downloads every bucket stepped on a GPU into the
    module's host copies, which a training loop never does each step; records before 9ab2415 paid one look inside
    each timed window (of the order of 0.2 s for Qwen3-1.7B's state on the GPU, over 8 steps)."""

    def wait() -> None:
        get_engine().wait_for_work()
        for i in cuda_indices:
            torch.cuda.synchronize(i)

    return wait
