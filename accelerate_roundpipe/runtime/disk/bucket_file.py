"""One bucket's swap file: created at its full size, read and written with positioned I/O straight into and out of
CPU tensors' memory (no copy through Python bytes, no build step, no extension).

[Note: swap file per bucket]
Each bucket has a file of its own (rather than one file per run at per-bucket offsets): a failed or short I/O names
the bucket's file; buffered writes to one file serialise on its inode lock on Linux filesystems, so writes of
different buckets in flight at once go to different files; and each file is reserved at its exact size with
`posix_fallocate` when created, so a disk that fills up fails at the start, not in the middle of a step. A run has
one file per trainable bucket past the host budget (tens to a few hundred), well under any open-file limit.

A transfer that returns fewer bytes than asked is continued from where it stopped (Linux moves at most 2 GiB - 4 KiB
per call); one that moves nothing before the end (the file ended, or the disk took nothing) is an error naming the
file and the byte it stopped at: a short read is never data.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch

from .errors import SwapIOError
from .layout import BucketLayout

# The system calls, named here so that a test can stand in for the disk (a write that takes nothing).
_pwrite = os.pwrite
_preadv = os.preadv


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (the tensor must outlive it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"swap I/O needs a contiguous CPU tensor, got one on {tensor.device} with strides "
                         f"{tensor.stride()}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def write_at(fd: int, data: memoryview, offset: int, path: str) -> None:
    """All of `data` into the file at `offset`."""
    done = 0
    while done < len(data):
        moved = _pwrite(fd, data[done:], offset + done)
        if moved <= 0:
            raise SwapIOError(f"short write to {path}: {done} of {len(data)} bytes at offset {offset} were written, "
                              f"then the disk took nothing", path)
        done += moved


def read_at(fd: int, data: memoryview, offset: int, path: str) -> None:
    """`len(data)` bytes of the file from `offset` into `data`."""
    done = 0
    while done < len(data):
        moved = _preadv(fd, [data[done:]], offset + done)
        if moved <= 0:
            raise SwapIOError(f"short read from {path}: the file ended after {done} of {len(data)} bytes at offset "
                              f"{offset} (a truncated or replaced swap file)", path)
        done += moved


class BucketFile:
    """The swap file of one bucket, `layout.nbytes` long, open for reading and writing until `close()`."""

    def __init__(self, path: str, layout: BucketLayout) -> None:
        self.path, self.layout = path, layout
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as error:
            raise SwapIOError(f"could not create the swap file {path}: {error}", path) from error
        try:
            if layout.nbytes:
                os.posix_fallocate(self.fd, 0, layout.nbytes)  # reserve it now: a full disk fails here, not mid-step
        except OSError as error:
            os.close(self.fd)
            os.unlink(path)
            raise SwapIOError(f"could not reserve {layout.nbytes} bytes for the swap file {path}: {error}",
                              path) from error

    def write_range(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Bytes [start, stop) of `buffer` (a slot: the file's image) into the same bytes of the file."""
        write_at(self.fd, byte_view(buffer)[start:stop], start, self.path)

    def read_range(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Bytes [start, stop) of the file into the same bytes of `buffer`."""
        read_at(self.fd, byte_view(buffer)[start:stop], start, self.path)

    def write_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the bucket's tensors (its layout's names, sizes and dtypes) from their own memory, synchronously:
        the first values, or a state loaded from a checkpoint."""
        self.layout.check_matches(tensors)
        for spec, offset in zip(self.layout.specs, self.layout.offsets):
            write_at(self.fd, byte_view(tensors[spec.name]), offset, self.path)

    def read_tensors_into(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read the bucket's tensors into `tensors` (its layout's names, sizes and dtypes), synchronously."""
        self.layout.check_matches(tensors)
        for spec, offset in zip(self.layout.specs, self.layout.offsets):
            read_at(self.fd, byte_view(tensors[spec.name]), offset, self.path)

    def read_tensors(self) -> dict[str, torch.Tensor]:
        """The bucket's tensors, read into new CPU tensors."""
        out = {spec.name: torch.empty(spec.numel, dtype=spec.dtype) for spec in self.layout.specs}
        self.read_tensors_into(out)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
