"""[Note: casts between two GPUs in slices]: with the optimizer state on the GPUs, a task on one GPU reads the
optimizer copy of a bucket homed on another, and sends it gradients, each cast on the way. Between two devices the
copy runs in slices (torch's cast across GPUs goes through a temporary as large as one copy); on one device it is
one copy. A CPU worker stands for one GPU and a "meta" tensor for the other GPU's memory (nothing is copied into or
out of it: the copies are recorded)."""

from __future__ import annotations

import torch

from accelerate_roundpipe.runtime.devices import device as device_module
from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice


class RecordingDevice(CpuDevice):
    """A CPU worker that logs each device-side copy's (destination device, offset, elements)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), 0)
        self.copies: list[tuple[str, int, int]] = []

    def _copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append((dst.device.type, dst.storage_offset(), dst.numel()))
        if "meta" not in (dst.device.type, src.device.type):
            super()._copy_on_device(dst, src)


def _device() -> RecordingDevice:
    device = RecordingDevice()
    device.start_thread()
    return device


def test_an_optimizer_copy_on_another_device_is_cast_into_the_upload_in_slices(monkeypatch):
    monkeypatch.setattr(device_module, "UPLOAD_CAST_CHUNK", 32)
    device = _device()
    elsewhere = torch.empty(100, dtype=torch.float32, device="meta")  # a bucket homed on the other GPU
    flat = torch.empty(100, dtype=torch.bfloat16)
    device.upload_params_into([flat], [elsewhere])
    assert device.copies == [("cpu", 0, 32), ("cpu", 32, 32), ("cpu", 64, 32), ("cpu", 96, 4)]


def test_an_optimizer_copy_on_the_same_device_is_cast_in_one_copy(monkeypatch):
    monkeypatch.setattr(device_module, "UPLOAD_CAST_CHUNK", 32)
    device = _device()
    here = torch.randn(100, dtype=torch.float32)  # a bucket homed on this device
    flat = torch.empty(100, dtype=torch.bfloat16)
    device._copy_between_devices(flat, here, 32)
    assert device.copies == [("cpu", 0, 100)]
    assert torch.equal(flat, here.to(torch.bfloat16))


def test_gradients_for_a_bucket_homed_on_another_device_are_cast_in_slices(monkeypatch):
    monkeypatch.setattr(device_module, "GRAD_DOWNLOAD_SLICE", 40)
    device = _device()
    grad = torch.randn(100, dtype=torch.float64).to(torch.bfloat16)
    home_buffer = torch.empty(100, dtype=torch.float32, device="meta")
    payload = device.download_grads_into([grad], [home_buffer])
    assert device.copies == [("meta", 0, 40), ("meta", 40, 40), ("meta", 80, 20)]
    squares = payload.host()[-1]  # the norm is measured where the gradient is
    assert torch.allclose(squares, grad.float().square().sum().reshape(1))
