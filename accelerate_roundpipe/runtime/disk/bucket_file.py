"""One bucket's swap file: created at its full size, read and written with positioned I/O straight into and out of
CPU tensors' memory (no copy through Python bytes, no build step, no extension).

[Note: swap file per bucket]
Each bucket has a file of its own (rather than one file per run at per-bucket offsets): a failed or short I/O names
the bucket's file; buffered writes to one file serialise on its inode lock on Linux filesystems, so writes of
different buckets in flight at once go to different files; and each file is reserved at its exact size with
`posix_fallocate` when created, so a disk that fills up fails at the start, not in the middle of a step. A run has
one file per trainable bucket past the host budget (tens to a few hundred), well under any open-file limit; a large
bucket's file is cut into up to 8 pieces ([Note: swap files in pieces]), which keeps it under a few thousand.

A transfer that returns fewer bytes than asked is continued from where it stopped (Linux moves at most 2 GiB - 4 KiB
per call); one that moves nothing before the end (the file ended, or the disk took nothing) is an error naming the
file and the byte it stopped at: a short read is never data.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Mapping

import numpy as np
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


def piece_path(path: str, index: int) -> str:
    """The file of a bucket's piece `index`: `path` itself for the first, `bucket-3.1.swap`... for the others."""
    if index == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{index}{ext}"


class BucketFile:
    """The swap file of one bucket, `layout.nbytes` long, open for reading and writing until `close()`: one file, or
    one a piece when the layout has splits ([Note: swap files in pieces]). `path` names the first."""

    def __init__(self, path: str, layout: BucketLayout) -> None:
        self.path, self.layout = path, layout
        self.pieces = layout.pieces()
        self.paths = tuple(piece_path(path, i) for i in range(len(self.pieces)))
        self.fds: list[int] = []
        try:
            for piece_file, (start, stop) in zip(self.paths, self.pieces):
                self.fds.append(_create(piece_file, stop - start))
        except BaseException:
            self.close()
            for piece_file in self.paths[:len(self.fds)]:
                os.unlink(piece_file)
            raise

    def chunks(self, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
        """Bytes [0, nbytes) of the image as (start, stop) chunks of at most `chunk_bytes`, each inside one piece,
        taken from the pieces in turn: chunks in flight together go to different files where there are several."""
        per_piece = []
        for start, stop in self.pieces:
            stop = min(stop, nbytes)
            per_piece.append([(a, min(a + chunk_bytes, stop)) for a in range(start, stop, chunk_bytes)])
        out = [chunk for turn in itertools.zip_longest(*per_piece) for chunk in turn if chunk is not None]
        return out or [(0, 0)]

    def _spans(self, start: int, stop: int):
        """(descriptor, path, offset in its file, start, stop in the image) of each piece that [start, stop) meets."""
        for i, (a, b) in enumerate(self.pieces):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield self.fds[i], self.paths[i], lo - a, lo, hi

    def write_range(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Bytes [start, stop) of `buffer` (a slot: the file's image) into the same bytes of the file."""
        self._move(write_at, byte_view(buffer), 0, start, stop)

    def read_range(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Bytes [start, stop) of the file into the same bytes of `buffer`."""
        self._move(read_at, byte_view(buffer), 0, start, stop)

    def write_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the bucket's tensors (its layout's names, sizes and dtypes) from their own memory, synchronously:
        the first values, or a state loaded from a checkpoint."""
        self.layout.check_matches(tensors)
        for spec, offset in zip(self.layout.specs, self.layout.offsets):
            self._move(write_at, byte_view(tensors[spec.name]), offset, offset, offset + spec.nbytes)

    def read_tensors_into(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read the bucket's tensors into `tensors` (its layout's names, sizes and dtypes), synchronously."""
        self.layout.check_matches(tensors)
        for spec, offset in zip(self.layout.specs, self.layout.offsets):
            self._move(read_at, byte_view(tensors[spec.name]), offset, offset, offset + spec.nbytes)

    def _move(self, move, data: memoryview, data_start: int, start: int, stop: int) -> None:
        """`move` (`read_at` or `write_at`) image bytes [start, stop) piece by piece; `data` holds the image's bytes
        from `data_start` on."""
        for fd, path, file_offset, lo, hi in self._spans(start, stop):
            move(fd, data[lo - data_start:hi - data_start], file_offset, path)

    def read_tensors(self) -> dict[str, torch.Tensor]:
        """The bucket's tensors, read into new CPU tensors."""
        out = {spec.name: torch.empty(spec.numel, dtype=spec.dtype) for spec in self.layout.specs}
        self.read_tensors_into(out)
        return out

    def mapped(self, name: str) -> MappedFlat:
        """Tensor `name` of the file, mapped copy-on-write (read when read; a write changes no file), piece by
        piece."""
        index = [spec.name for spec in self.layout.specs].index(name)
        spec, offset = self.layout.specs[index], self.layout.offsets[index]
        size = spec.dtype.itemsize
        segments = []
        for _, path, file_offset, lo, hi in self._spans(offset, offset + spec.nbytes):
            array = np.memmap(path, dtype=np.uint8, mode="c", offset=file_offset, shape=(hi - lo,))
            segments.append(((lo - offset) // size, torch.from_numpy(array).view(spec.dtype)))
        return MappedFlat(spec.numel, spec.dtype, segments)

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = [-1] * len(self.fds)


class MappedFlat:
    """A flat tensor of a swap file mapped piece by piece: `flat[a:b]` is a view when [a, b) lies in one piece
    (every parameter's slice does: the disk tier splits at parameter boundaries), else a new tensor read whole."""

    def __init__(self, numel: int, dtype: torch.dtype, segments: list[tuple[int, torch.Tensor]]) -> None:
        self._numel, self.dtype, self.segments = numel, dtype, segments

    def numel(self) -> int:
        return self._numel

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a mapped swap tensor takes contiguous slices, got {index!r}")
        start, stop, _ = index.indices(self._numel)
        stop = max(start, stop)
        for first, segment in self.segments:
            if first <= start and stop <= first + segment.numel():
                return segment[start - first:stop - first]
        parts = [segment[max(start, first) - first:min(stop, first + segment.numel()) - first]
                 for first, segment in self.segments if first < stop and start < first + segment.numel()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)


def _create(path: str, nbytes: int) -> int:
    """A new file at `path`, reserved at `nbytes` (a full disk fails here, not mid-step); its descriptor."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as error:
        raise SwapIOError(f"could not create the swap file {path}: {error}", path) from error
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        os.close(fd)
        os.unlink(path)
        raise SwapIOError(f"could not reserve {nbytes} bytes for the swap file {path}: {error}", path) from error
    return fd
