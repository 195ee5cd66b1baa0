"""Chunk packing of parameter and gradient traffic into the copy engine's gaps between activation copies."""

from __future__ import annotations

import random

import pytest

from accelerate_roundpipe.plan.packing import Chunk, pack_chunks, split_chunks


def bytes_by_transfer(chunks):
    """name -> sorted (offset, stop) intervals."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for c in chunks:
        seen.setdefault(c.name, []).append((c.offset, c.offset + c.nbytes))
    return {name: sorted(v) for name, v in seen.items()}


def check(transfers, gaps, bytes_per_s, chunk_bytes):
    packed = pack_chunks(transfers, gaps, bytes_per_s, chunk_bytes)
    every = [c for gap in packed.gaps for c in gap] + list(packed.overflow)
    # Every byte of every transfer exactly once: intervals tile [0, size) with no overlap and no hole.
    intervals = bytes_by_transfer(every)
    for name, size in transfers:
        position = 0
        for start, stop in intervals.pop(name, []) if size else []:
            assert start == position and stop > start
            position = stop
        assert position == size, name
    assert not intervals  # nothing invented
    assert all(0 < c.nbytes <= chunk_bytes for c in every)
    for index, gap in enumerate(packed.gaps):
        assert packed.gap_bytes(index) <= gaps[index] * bytes_per_s  # no gap overfilled
        assert [c.nbytes for c in gap] == sorted((c.nbytes for c in gap), reverse=True)  # longest first
    # Overflow only what fit nowhere: each overflowing chunk is larger than every gap's room at the end.
    for c in packed.overflow:
        assert all(packed.gap_bytes(i) + c.nbytes > packed.capacity_bytes[i] for i in range(len(gaps)))
    return packed


def test_random_transfers_respect_every_invariant():
    rng = random.Random(0)
    for _ in range(300):
        transfers = [(f"layer{i}", rng.choice([0, rng.randint(1, 5000)])) for i in range(rng.randint(0, 12))]
        gaps = [rng.uniform(0, 2e-3) for _ in range(rng.randint(0, 8))]
        check(transfers, gaps, bytes_per_s=1e6, chunk_bytes=rng.randint(1, 1500))


def test_split_chunks_bounds_sizes():
    assert split_chunks([("head", 10), ("empty", 0), ("norm", 3)], 4) == [
        Chunk("head", 0, 4), Chunk("head", 4, 4), Chunk("head", 8, 2), Chunk("norm", 0, 3)]
    with pytest.raises(ValueError, match="chunk_bytes"):
        split_chunks([("a", 1)], 0)


def test_large_block_spreads_evenly_over_the_windows():
    # The LM head cut into shards spreads over the per-micro-batch windows: every window carries about as much.
    packed = check([("lm_head", 800), ("layer0", 100), ("layer1", 100)], [1.0] * 4, bytes_per_s=300, chunk_bytes=100)
    assert not packed.overflow
    assert sorted(packed.gap_bytes(i) for i in range(4)) == [200, 200, 300, 300]
    assert "gap 0:" in str(packed) and "overflow: 0 B -" in str(packed)


def test_overflow_when_the_gaps_are_too_small():
    packed = check([("a", 100), ("b", 30)], [0.5, 0.2], bytes_per_s=100, chunk_bytes=60)
    # Chunks 60, 40, 30 into rooms of 50 and 20 bytes: 60 fits no gap, 40 takes the 50, then 30 fits neither the
    # 10 bytes left there nor the 20-byte gap.
    assert packed.gaps == ((Chunk("a", 60, 40),), ())
    assert packed.overflow == (Chunk("a", 0, 60), Chunk("b", 0, 30))
    assert packed.overflow_bytes == 90 and "overflow: 90 B" in str(packed)


def test_empty_inputs():
    assert pack_chunks([], [], 1e9, 1024).gaps == ()
    nothing = pack_chunks([], [1e-3, 2e-3], 1e9, 1024)
    assert nothing.gaps == ((), ()) and nothing.overflow == ()
    no_gaps = pack_chunks([("a", 10)], [], 1e9, 4)
    assert no_gaps.overflow_bytes == 10
    with pytest.raises(ValueError, match="bytes_per_s"):
        pack_chunks([], [], 0, 1)
    with pytest.raises(ValueError, match="gaps"):
        pack_chunks([], [-1.0], 1, 1)
