"""The `Device` class a worker's torch device gets, and the device made from it ([Note: devices as classes]).

Apart from `device.py` so that the device classes import the interface and the choice imports the classes, never
both ways."""

from __future__ import annotations

import torch

from .cpu_device import CpuDevice
from .cuda_device import CudaDevice
from .device import Device

# The class CPU workers get; None: `CpuDevice` (tests swap in the stream model).
cpu_device_class: type[Device] | None = None


def device_class(device: torch.device) -> type[Device]:
    """The `Device` class for `device`: CUDA's on a GPU, else the CPU worker's."""
    if device.type == "cuda":
        return CudaDevice
    if cpu_device_class is not None:
        return cpu_device_class
    return CpuDevice


def make_device(device: torch.device | str, index: int) -> Device:
    """Worker `index`'s device on `device`, of the class `device_class` picks."""
    device = torch.device(device)
    return device_class(device)(device, index)
