"""Callers ask a device what they need (`tracks_memory`, `total_memory_bytes`, `timer`, ...) instead of testing for
CUDA ([Note: devices as classes]), so the GPU half of the profiler, the measured plan's budget and the live metrics
runs on CPU workers too, against a device that counts memory like CUDA's allocator."""

from __future__ import annotations

import torch

from accelerate_roundpipe import RoundPipeConfig
from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice
from accelerate_roundpipe.runtime.execution.layer_profile import LayerProfile, LayerRun
from accelerate_roundpipe.runtime.execution.measured_plan import memory_budget_bytes
from accelerate_roundpipe.telemetry.metrics import gpu_peak_gib


class CountingDevice(CpuDevice):
    """A CPU worker with an allocator's counters: `allocated` now, `peak` since the last reset."""

    tracks_memory = True

    def __init__(self, index: int = 0, total: int | None = None) -> None:
        super().__init__(torch.device("cpu"), index)
        self.total, self.allocated, self.peak = total, 0, 0

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory(self) -> None:
        self.peak = self.allocated

    def allocated_bytes(self) -> int:
        return self.allocated

    def peak_allocated_bytes(self) -> int | None:
        return self.peak

    def total_memory_bytes(self) -> int | None:
        return self.total


def test_the_profiler_reads_a_device_s_memory_counters_around_each_layer():
    device, profile = CountingDevice(), LayerProfile(num_layers=2)
    device.allocate(1000)  # what was there before: not the layer's
    with profile.measure(LayerRun.FORWARD_WITH_GRAPH, 0, device):
        device.allocate(300)  # kept for the backward
        device.allocate(200)
        device.allocated -= 200  # a transient
    with profile.measure(LayerRun.BACKWARD, 1, device):
        device.allocate(50)
        device.allocated -= 50
    with profile.measure(LayerRun.FORWARD, 1, device):  # a forward without a graph keeps nothing: not counted
        device.allocate(10_000)
    assert profile._act_bytes[0] == 300 and profile._work_bytes[0] == 200
    assert profile._act_bytes[1] == 0 and profile._work_bytes[1] == 50
    assert all(t.elapsed_s() >= 0 for timers in profile._timers.values() for t in timers)


def test_a_device_without_memory_counters_is_timed_only():
    device, profile = CpuDevice(torch.device("cpu"), 0), LayerProfile(num_layers=1)
    with profile.measure(LayerRun.FORWARD_WITH_GRAPH, 0, device, (torch.zeros(4),)):
        pass
    assert profile._act_bytes[0] == 0 and profile._input_bytes[0] == 16
    assert profile._timers[(LayerRun.FORWARD_WITH_GRAPH, 0)][0].elapsed_s() >= 0


def test_the_budget_is_the_smallest_device_memory_unless_given():
    devices = [CountingDevice(0, total=8 * 2**30), CountingDevice(1, total=6 * 2**30), CpuDevice("cpu", 2)]
    assert memory_budget_bytes(RoundPipeConfig(devices=["cpu"]), devices) == 6 * 2**30
    assert memory_budget_bytes(RoundPipeConfig(devices=["cpu"], gpu_memory_budget=2.0), devices) == 2 * 2**30
    assert memory_budget_bytes(RoundPipeConfig(devices=["cpu"]), [CpuDevice("cpu", 0)]) is None


def test_the_peak_metric_is_the_highest_device_peak():
    first, second = CountingDevice(0), CountingDevice(1)
    first.allocate(2**30)
    second.allocate(3 * 2**30)
    assert gpu_peak_gib([first, second, CpuDevice("cpu", 2)]) == 3.0
    assert gpu_peak_gib([CpuDevice("cpu", 0)]) == 0.0
