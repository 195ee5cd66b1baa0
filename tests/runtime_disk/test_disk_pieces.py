"""[Note: swap files in pieces]: a bucket's image cut at element splits into several files, so that the I/O threads
write different files at once (buffered writes to one file serialise on its inode lock). Every byte lands where the
one-file layout puts it in the image; the staging's chunks take the pieces in turn; a mapped tensor is a view of one
piece for every slice inside a piece; the disk tier cuts at parameter boundaries."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from accelerate_roundpipe.runtime.disk import BucketFile, BucketLayout, SwapIOError, TensorSpec, bucket_file
from accelerate_roundpipe.runtime.state import disk_tier

NUMEL = 10_000
SPLITS = (1_000, 2_500, 7_000)


def _layout() -> BucketLayout:
    return BucketLayout.of([TensorSpec(n, NUMEL, torch.float32) for n in ("optim", "exp_avg", "exp_avg_sq")],
                           SPLITS)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUMEL, generator=g) for n in ("optim", "exp_avg", "exp_avg_sq")}


def test_the_pieces_cover_the_image_cut_at_every_tensors_splits():
    layout = _layout()
    pieces = layout.pieces()
    assert pieces[0][0] == 0 and pieces[-1][1] == layout.nbytes
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, in order
    cuts = {a for a, _ in pieces}
    for offset in layout.offsets:
        assert {offset + s * 4 for s in SPLITS} <= cuts
    assert len(pieces) == 3 * len(SPLITS) + 1  # a piece ends one tensor and begins the next
    assert BucketLayout.of([TensorSpec("optim", NUMEL, torch.float32)]).pieces() == ((0, 40_960),)
    with pytest.raises(ValueError, match="increasing positive"):
        BucketLayout.of([TensorSpec("optim", NUMEL, torch.float32)], (5, 3))


def test_a_bucket_in_pieces_holds_the_same_image_as_one_file(tmp_path):
    tensors = _tensors(0)
    pieced = BucketFile(str(tmp_path / "bucket-0.swap"), _layout())
    whole_layout = BucketLayout.of(list(_layout().specs))
    whole = BucketFile(str(tmp_path / "bucket-1.swap"), whole_layout)
    try:
        assert len(pieced.paths) == len(_layout().pieces()) and all(os.path.exists(p) for p in pieced.paths)
        assert os.path.basename(pieced.paths[1]) == "bucket-0.1.swap"
        assert sum(os.path.getsize(p) for p in pieced.paths) == pieced.layout.nbytes  # each reserved at its size
        pieced.write_tensors(tensors)
        whole.write_tensors(tensors)
        images = []
        for file in (pieced, whole):
            image = torch.empty(file.layout.nbytes, dtype=torch.uint8)
            file.read_range(image, 0, file.layout.nbytes)
            images.append(image)
        assert torch.equal(images[0], images[1])
        back = pieced.read_tensors()
        assert all(torch.equal(back[n], tensors[n]) for n in tensors)
        # a range across piece boundaries, written from an image and read back
        image = images[0].clone()
        image[3_000:30_000] = 7
        pieced.write_range(image, 3_000, 30_000)
        again = torch.zeros_like(image)
        pieced.read_range(again, 0, image.numel())
        assert torch.equal(again, image)
    finally:
        pieced.close()
        whole.close()


def test_the_chunks_take_the_pieces_in_turn_each_inside_one(tmp_path):
    file = BucketFile(str(tmp_path / "bucket-0.swap"), _layout())
    try:
        chunks = file.chunks(file.layout.nbytes, 8192)
        assert sorted(chunks) == sorted(set(chunks)) and sum(b - a for a, b in chunks) == file.layout.nbytes
        piece_of = [next(i for i, (a, b) in enumerate(file.pieces) if a <= lo and hi <= b) for lo, hi in chunks]
        assert piece_of[:len(file.pieces)] == list(range(len(file.pieces)))  # the first chunk of every piece first
        one = BucketFile(str(tmp_path / "bucket-1.swap"), BucketLayout.of(list(_layout().specs)))
        assert one.chunks(20_000, 8192) == [(0, 8192), (8192, 16384), (16384, 20000)]  # one file: as before
        one.close()
    finally:
        file.close()


def test_a_mapped_tensor_is_a_view_of_one_piece_for_every_slice_inside_one(tmp_path):
    tensors = _tensors(1)
    file = BucketFile(str(tmp_path / "bucket-0.swap"), _layout())
    try:
        file.write_tensors(tensors)
        flat = file.mapped("exp_avg")
        assert flat.numel() == NUMEL and len(flat.segments) == len(SPLITS) + 1
        bounds = (0, *SPLITS, NUMEL)
        for a, b in zip(bounds, bounds[1:]):
            part = flat[a:b]
            assert torch.equal(part, tensors["exp_avg"][a:b])
            storages = {seg.untyped_storage().data_ptr() for _, seg in flat.segments}
            assert part.untyped_storage().data_ptr() in storages  # a view, nothing read into memory of its own
        assert torch.equal(flat[500:3_000], tensors["exp_avg"][500:3_000])  # across pieces: read whole
        assert torch.equal(flat[0:NUMEL], tensors["exp_avg"])
        flat[0:10].fill_(0)  # copy-on-write: the file keeps its values
        assert torch.equal(file.read_tensors()["exp_avg"], tensors["exp_avg"])
    finally:
        file.close()


def test_a_short_read_names_the_piece_it_stopped_in(tmp_path):
    file = BucketFile(str(tmp_path / "bucket-5.swap"), _layout())
    try:
        os.truncate(file.paths[2], 100)
        with pytest.raises(SwapIOError, match=r"short read from .*bucket-5\.2\.swap"):
            file.read_tensors()
    finally:
        file.close()


def _bucket(sizes: list[int]) -> SimpleNamespace:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return SimpleNamespace(optim=torch.empty(sum(sizes)), slots=[SimpleNamespace(offset=o) for o in offsets])


def test_the_disk_tier_cuts_at_parameter_boundaries_near_equal_shares():
    # a decoder layer's shape: attention's four, then three MLP matrices (in elements)
    sizes = [400, 100, 100, 400, 1000, 1000, 1000]
    bucket = _bucket(sizes)
    offsets = {s.offset for s in bucket.slots}
    splits = disk_tier.piece_splits(bucket, piece_bytes=4 * 1000, max_pieces=8)  # 4 pieces asked
    assert splits and set(splits) <= offsets - {0} and list(splits) == sorted(set(splits))
    assert splits == (1000, 2000, 3000)
    assert disk_tier.piece_splits(bucket, piece_bytes=4 * 4000) == ()  # small: one file
    assert disk_tier.piece_splits(_bucket([4000]), piece_bytes=4) == ()  # one parameter: nothing to cut at
    assert len(disk_tier.piece_splits(bucket, piece_bytes=4, max_pieces=3)) <= 2


def test_the_short_write_check_still_names_a_piece(tmp_path, monkeypatch):
    file = BucketFile(str(tmp_path / "bucket-6.swap"), _layout())
    try:
        monkeypatch.setattr(bucket_file, "_pwrite", lambda fd, data, offset: 0)
        with pytest.raises(SwapIOError, match=r"short write to .*bucket-6\.swap"):
            file.write_tensors(_tensors(2))
    finally:
        file.close()
