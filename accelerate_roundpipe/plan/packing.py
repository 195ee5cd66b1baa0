"""Parameter and gradient traffic packed into the copy engine's idle gaps between activation copies.

Activations are on the critical path, so they own the copy stream; parameters and gradients are low priority and
may use only the gaps between activation copies. `pack_chunks` cuts each transfer into chunks of at most `chunk_bytes`
(so a large block, the LM head, spreads over several gaps) and assigns them longest first, each to the gap with the
most room left (longest-processing-time first: the gaps end up carrying about the same bytes, so none is overfilled
and no activation copy waits). A chunk that does not fit the roomiest gap fits nowhere: it goes to the overflow, sent
after the last gap, and the caller sees the overflow in the result.

A pure function over numbers; the transfer engine turns the assignment into copies.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Chunk(NamedTuple):
    """Bytes [offset, offset + nbytes) of the transfer `name`."""

    name: str
    offset: int
    nbytes: int

    def __str__(self) -> str:
        return f"{self.name}[{self.offset}:{self.offset + self.nbytes}]"


@dataclass(frozen=True)
class PackedChunks:
    """`gaps[i]` lists the chunks sent in gap i, longest first; `overflow` what fit in no gap."""

    gaps: tuple[tuple[Chunk, ...], ...]
    capacity_bytes: tuple[float, ...]  # of each gap: its seconds times bytes_per_s
    overflow: tuple[Chunk, ...]

    @property
    def overflow_bytes(self) -> int:
        return sum(c.nbytes for c in self.overflow)

    def gap_bytes(self, index: int) -> int:
        return sum(c.nbytes for c in self.gaps[index])

    def __str__(self) -> str:
        lines = []
        for i, (chunks, capacity) in enumerate(zip(self.gaps, self.capacity_bytes)):
            used = self.gap_bytes(i)
            fill = f"{used / capacity:.0%}" if capacity else "-"
            lines.append(f"gap {i}: {used}/{capacity:.0f} B ({fill}) " + (" ".join(map(str, chunks)) or "-"))
        lines.append(f"overflow: {self.overflow_bytes} B " + (" ".join(map(str, self.overflow)) or "-"))
        return "\n".join(lines)


def split_chunks(transfers: Sequence[tuple[str, int]], chunk_bytes: int) -> list[Chunk]:
    """Each transfer cut into chunks of `chunk_bytes` (the last one shorter); empty transfers give none."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}.")
    chunks = []
    for name, nbytes in transfers:
        if nbytes < 0:
            raise ValueError(f"transfer {name!r} has {nbytes} bytes; sizes must be >= 0.")
        chunks += [Chunk(name, offset, min(chunk_bytes, nbytes - offset)) for offset in range(0, nbytes, chunk_bytes)]
    return chunks


def pack_chunks(chunks: Sequence[tuple[str, int]], gaps: Sequence[float], bytes_per_s: float,
                chunk_bytes: int) -> PackedChunks:
    """Assign the transfers `chunks` ((name, bytes) pairs) to the copy-engine `gaps` (idle seconds between
    activation copies, in time order), cut into pieces of at most `chunk_bytes`, longest first, each to the gap with
    the most room left; what fits nowhere goes to the overflow."""
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}.")
    if any(not g >= 0 for g in gaps):
        raise ValueError(f"gaps must be >= 0 seconds, got {list(gaps)}.")
    pieces = split_chunks(chunks, chunk_bytes)
    # Longest first; ties keep the transfers' order (sorted is stable), so the result is deterministic.
    pieces.sort(key=lambda c: -c.nbytes)
    capacity = tuple(g * bytes_per_s for g in gaps)
    assigned: list[list[Chunk]] = [[] for _ in gaps]
    room = [(-c, i) for i, c in enumerate(capacity)]  # max-heap on room left, earliest gap on ties
    heapq.heapify(room)
    overflow = []
    for piece in pieces:
        if not room or -room[0][0] < piece.nbytes:
            overflow.append(piece)  # the roomiest gap is too small, so every gap is
            continue
        left, index = heapq.heappop(room)
        assigned[index].append(piece)
        heapq.heappush(room, (left + piece.nbytes, index))
    return PackedChunks(gaps=tuple(map(tuple, assigned)), capacity_bytes=capacity, overflow=tuple(overflow))
