"""Swap files: a bucket's tensors at 4 KiB-aligned offsets, written and read back bit for bit, and a short read or
write refused as an error naming the file."""

from __future__ import annotations

import os

import pytest
import torch

from accelerate_roundpipe.runtime.disk import ALIGN, BucketFile, BucketLayout, SwapIOError, TensorSpec, bucket_file


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"optim": torch.randn(4099, generator=g, dtype=torch.float32),  # odd sizes: nothing lands on a page edge
            "exp_avg": torch.randn(1, generator=g, dtype=torch.float64),
            "exp_avg_sq": torch.randn(12_345, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, dtype=torch.float32)}


def test_layout_aligns_every_tensor_to_4_kib():
    layout = BucketLayout.like(_tensors(0))
    # 4099 x 4 = 16396 bytes -> next at 20480; 8 bytes -> 24576; 12345 x 2 = 24690 -> 49266, rounded to 53248.
    assert layout.offsets == (0, 20_480, 24_576, 53_248)
    assert layout.nbytes == 53_248 and all(offset % ALIGN == 0 for offset in layout.offsets)
    with pytest.raises(ValueError, match="distinct names"):
        BucketLayout.of([TensorSpec("a", 1, torch.float32), TensorSpec("a", 2, torch.float32)])


def test_tensors_round_trip_bitwise_through_a_file(tmp_path):
    tensors = _tensors(1)
    layout = BucketLayout.like(tensors)
    file = BucketFile(str(tmp_path / "bucket-0.swap"), layout)
    assert os.path.getsize(file.path) == layout.nbytes  # reserved whole when made
    file.write_tensors(tensors)
    back = file.read_tensors()
    file.close()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8)), name  # bits, NaNs included


def test_a_read_past_the_end_of_a_truncated_file_is_an_error_naming_it(tmp_path):
    tensors = _tensors(2)
    file = BucketFile(str(tmp_path / "bucket-7.swap"), BucketLayout.like(tensors))
    file.write_tensors(tensors)
    os.truncate(file.path, 30_000)  # cuts exp_avg_sq (at 24576, 24690 bytes) short
    with pytest.raises(SwapIOError, match=r"short read from .*bucket-7\.swap: the file ended after 5424 of 24690") \
            as caught:
        file.read_tensors()
    assert caught.value.path == file.path
    file.close()


def test_a_write_the_disk_takes_nothing_of_is_an_error_not_silence(tmp_path, monkeypatch):
    tensors = _tensors(3)
    file = BucketFile(str(tmp_path / "bucket-1.swap"), BucketLayout.like(tensors))
    calls = []

    def half_then_nothing(fd, data, offset):  # the disk takes half the first write, then nothing
        calls.append(len(data))
        return os.pwrite(fd, data[:len(data) // 2], offset) if len(calls) == 1 else 0

    monkeypatch.setattr(bucket_file, "_pwrite", half_then_nothing)
    with pytest.raises(SwapIOError, match=r"short write to .*bucket-1\.swap: 8198 of 16396 bytes at offset 0"):
        file.write_tensors(tensors)
    assert calls == [16_396, 8_198]  # the rest was asked for again, from where the first write stopped
    file.close()


def test_tensors_that_are_not_the_layout_are_refused_before_any_byte_moves(tmp_path):
    tensors = _tensors(4)
    file = BucketFile(str(tmp_path / "bucket-2.swap"), BucketLayout.like(tensors))
    wrong = dict(tensors, optim=tensors["optim"].double())
    with pytest.raises(ValueError, match="do not match the bucket's layout"):
        file.write_tensors(wrong)
    assert not any(file.read_tensors()["optim"].view(torch.int32))  # still the reserved zeros
    file.close()
