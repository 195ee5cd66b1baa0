"""[Note: parameter uploads in chunks]: a bucket's upload is a run of copies of at most `PARAM_UPLOAD_CHUNK_BYTES`,
in order, that together write exactly the bucket; a cast upload and a small bucket stay as they were."""

from __future__ import annotations

import torch

from accelerate_roundpipe.runtime.devices import device as device_module
from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice


class RecordingDevice(CpuDevice):
    """A CPU worker that logs each host-to-device copy's (destination offset, elements)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), 0)
        self.copies: list[tuple[int, int]] = []

    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append((dst.storage_offset(), dst.numel()))
        super()._copy_to_device(dst, src)


def test_a_large_bucket_uploads_in_chunks_in_order_and_a_small_one_in_one_copy(monkeypatch):
    monkeypatch.setattr(device_module, "PARAM_UPLOAD_CHUNK_BYTES", 64)  # 32 bfloat16 elements a copy
    device = RecordingDevice()
    device.start_thread()
    large = torch.randn(100, dtype=torch.float64).to(torch.bfloat16)
    small = torch.randn(20, dtype=torch.float64).to(torch.bfloat16)
    flats = [torch.empty_like(large), torch.empty_like(small)]
    events = device.upload_params_into(flats, [large, small])
    assert len(events) == 2
    assert torch.equal(flats[0], large) and torch.equal(flats[1], small)
    # 100 elements in copies of 32, 32, 32, 4, one after the other; the small bucket in one copy
    assert device.copies == [(0, 32), (32, 32), (64, 32), (96, 4), (0, 20)]


def test_an_upload_with_a_cast_keeps_its_own_staging_chunks(monkeypatch):
    monkeypatch.setattr(device_module, "PARAM_UPLOAD_CHUNK_BYTES", 64)
    device = RecordingDevice()
    device.start_thread()
    host = torch.randn(100, dtype=torch.float32)  # an optimizer copy read by the exact step, cast on the device
    flat = torch.empty(100, dtype=torch.bfloat16)
    device.upload_params_into([flat], [host])
    assert torch.equal(flat, host.to(torch.bfloat16))
    assert [n for _, n in device.copies] == [100]  # one staged copy (UPLOAD_CAST_CHUNK elements at a time)
