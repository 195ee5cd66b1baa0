"""Where each of a bucket's tensors lies in its swap file and in a staging slot: the same offsets in both.

A bucket's disk state is a few named flat tensors (its float32 optimizer copy, AdamW's exp_avg and exp_avg_sq). Each
starts at a multiple of `ALIGN` (4 KiB, the page and the usual disk block), in the order given, so that a whole
bucket is one contiguous byte range: read or written in one sequential pass, and viewed in a staging slot without a
copy (every dtype's element size divides 4 KiB, so the views are aligned too).

[Note: swap files in pieces]
A bucket's image may be cut into pieces, each in a file of its own, at `splits`: element indices that cut every
tensor of the image at the same elements (the disk tier cuts at parameter boundaries, so that every parameter's
values lie in one piece and a checkpoint can still map them without reading). Buffered writes to one file serialise
on its inode lock on Linux: through the page cache, 8 threads wrote one file at 5.0 GB/s and 8 files at 33.7 GB/s
on the H100 machine's ext4 (`benchmarks/swap_rate.py`), and the disk tier's step writes every disk bucket back. So
a bucket written in pieces is written by several threads at once. The slot keeps the one contiguous image.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

ALIGN = 4096


def align_up(n: int, multiple: int = ALIGN) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TensorSpec:
    """One named flat tensor of a bucket."""

    name: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    """A bucket's tensors at their aligned offsets; `nbytes` (a multiple of ALIGN) is its file's and slot's size."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    splits: tuple[int, ...] = ()  # element indices where each tensor goes on in the next piece file

    @classmethod
    def of(cls, specs: list[TensorSpec] | tuple[TensorSpec, ...], splits: tuple[int, ...] = ()) -> BucketLayout:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"a bucket's tensors need distinct names, got {names}")
        if list(splits) != sorted(set(splits)) or any(s <= 0 for s in splits):
            raise ValueError(f"a layout's splits must be increasing positive element indices, got {splits}")
        offsets, end = [], 0
        for spec in specs:
            if spec.numel < 0:
                raise ValueError(f"tensor {spec.name!r} has a negative size {spec.numel}")
            offsets.append(end)
            end = align_up(end + spec.nbytes)
        return cls(tuple(specs), tuple(offsets), end, tuple(splits))

    def pieces(self) -> tuple[tuple[int, int], ...]:
        """The image's byte ranges, one a piece file, in order and covering [0, nbytes): cut at each tensor's
        splits inside it, so a piece may end one tensor and begin the next; without splits, the whole image
        ([Note: swap files in pieces])."""
        cuts = {0, self.nbytes}
        for spec, offset in zip(self.specs, self.offsets):
            cuts.update(offset + s * spec.dtype.itemsize for s in self.splits if s < spec.numel)
        ordered = sorted(cuts)
        return tuple(zip(ordered[:-1], ordered[1:])) if self.nbytes else ((0, 0),)

    @classmethod
    def like(cls, tensors: Mapping[str, torch.Tensor]) -> BucketLayout:
        """The layout of these tensors (flattened), in their mapping's order."""
        return cls.of([TensorSpec(name, t.numel(), t.dtype) for name, t in tensors.items()])

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a flat view into `buffer` (uint8, at least `nbytes` long): a slot's tensors."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(f"a staging buffer must be flat uint8 of at least {self.nbytes} bytes, got "
                             f"{buffer.dtype} of shape {tuple(buffer.shape)}")
        return {spec.name: buffer[offset:offset + spec.nbytes].view(spec.dtype)
                for spec, offset in zip(self.specs, self.offsets)}

    def check_matches(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse tensors that are not this layout's (names, sizes, dtypes), before any byte moves."""
        want = {spec.name: (spec.numel, spec.dtype) for spec in self.specs}
        got = {name: (t.numel(), t.dtype) for name, t in tensors.items()}
        if want != got:
            raise ValueError(f"tensors do not match the bucket's layout: expected {want}, got {got}")
