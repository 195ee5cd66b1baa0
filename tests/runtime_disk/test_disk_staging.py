"""Bounded staging: reads run ahead in the scheduled order, never more than K slots in use, a dirty slot written back
before its bucket is read again, every I/O failure raised in the caller within the timeout, naming the file, and
close() waiting for the writes, then removing everything."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from accelerate_roundpipe.runtime.disk import (
    BucketLayout,
    DiskStaging,
    StagingOrderError,
    SwapFiles,
    SwapFolder,
    SwapIOError,
    SwapTimeoutError,
    TensorSpec,
)

SIZES = [1000, 4097, 123, 2048, 777, 5000]  # a different size per bucket: the slot fits the largest


def _layout(numel: int) -> BucketLayout:
    return BucketLayout.of([TensorSpec("optim", numel, torch.float32), TensorSpec("exp_avg", numel, torch.bfloat16),
                            TensorSpec("exp_avg_sq", numel, torch.float64)])


def _values(key: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(key)
    return {"optim": torch.randn(numel, generator=g), "exp_avg": torch.randn(numel, generator=g).bfloat16(),
            "exp_avg_sq": torch.randn(numel, generator=g, dtype=torch.float64)}


def _staging(tmp_path, slots: int, hook=None, timeout_s: float = 10.0, fill: bool = True) -> DiskStaging:
    folder = SwapFolder(str(tmp_path))
    files = SwapFiles(folder, {key: _layout(numel) for key, numel in enumerate(SIZES)})
    if fill:
        for key, numel in enumerate(SIZES):
            files[key].write_tensors(_values(key, numel))
    # Small chunks: each bucket moves in several pieces on several threads.
    return DiskStaging(files, slots, io_threads=3, timeout_s=timeout_s, hook=hook, chunk_bytes=8192)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_a_step_order_round_trips_bitwise_and_dirty_slots_are_written_back(tmp_path):
    staging = _staging(tmp_path, slots=2)
    order = list(reversed(range(len(SIZES))))  # the backward: last bucket first
    staging.schedule(order)
    for key in order:
        tensors = staging.acquire(key)
        assert _equal(tensors, _values(key, SIZES[key]))
        for t in tensors.values():
            t.mul_(2)  # the step, in the slot
        staging.release(key, dirty=key % 2 == 0)  # odd buckets released clean: their change is dropped
    staging.schedule(order)
    for key in order:
        want = {n: t * 2 if key % 2 == 0 else t for n, t in _values(key, SIZES[key]).items()}
        assert _equal(staging.acquire(key), want), key
        staging.release(key, dirty=False)
    staging.close()


def test_reads_run_ahead_but_never_more_than_k_slots_are_in_use(tmp_path):
    slots, seen = 3, []
    box = {}

    def slow(kind, path, offset, nbytes):  # every chunk takes a while, so reads and writes overlap the "steps"
        seen.append((kind, os.path.basename(path), box["staging"].in_use))
        time.sleep(0.002)

    staging = box["staging"] = _staging(tmp_path, slots, hook=slow)
    staging.schedule(range(len(SIZES)))
    deadline = time.monotonic() + 5
    while staging.in_use < slots and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # would a fourth read start? it must not
    reading = {name for kind, name, _ in seen if kind == "read"}
    assert reading == {"bucket-0.swap", "bucket-1.swap", "bucket-2.swap"}  # the first K in order, nothing more
    for key in range(len(SIZES)):
        staging.acquire(key)
        assert staging.in_use <= slots
        time.sleep(0.01)  # the step
        staging.release(key)
    staging.close()
    assert staging.peak_in_use == slots
    assert max(in_use for _, _, in_use in seen) <= slots
    assert {name for kind, name, _ in seen if kind == "write"} == {f"bucket-{k}.swap" for k in range(len(SIZES))}


def test_a_bucket_is_read_again_only_after_its_write_back_is_on_disk(tmp_path):
    events = []

    def record(kind, path, offset, nbytes):
        if os.path.basename(path) == "bucket-1.swap":
            events.append(kind)
            if kind == "write":
                time.sleep(0.05)  # a slow write-back: a read started now would read the old values

    staging = _staging(tmp_path, slots=2, hook=record)
    staging.schedule([1, 1])
    staging.acquire(1)["optim"].fill_(7.0)
    staging.release(1)
    assert staging.acquire(1)["optim"].eq(7.0).all()
    staging.release(1, dirty=False)
    staging.close()
    first_write = events.index("write")
    assert "read" not in events[first_write:first_write + events.count("write")]  # all writes before the reread


def test_acquires_out_of_order_or_past_the_slots_are_refused(tmp_path):
    staging = _staging(tmp_path, slots=2)
    with pytest.raises(StagingOrderError, match=r"acquire\(0\) out of order: the next scheduled bucket is none"):
        staging.acquire(0)
    staging.schedule([5, 4, 3])
    with pytest.raises(StagingOrderError, match=r"acquire\(4\) out of order: the next scheduled bucket is 5"):
        staging.acquire(4)
    staging.acquire(5)
    staging.acquire(4)
    with pytest.raises(StagingOrderError, match=r"acquire\(3\) while all 2 staging slots are held"):
        staging.acquire(3)
    with pytest.raises(StagingOrderError, match=r"release\(3\) of a bucket not held"):
        staging.release(3)
    with pytest.raises(KeyError, match="without a swap file: \\[9\\]"):
        staging.schedule([9])
    staging.release(5)
    staging.release(4)
    staging.acquire(3)  # the refusals changed nothing
    staging.release(3)
    staging.close()
    with pytest.raises(StagingOrderError, match="closed"):
        staging.schedule([0])


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_failed_io_thread_surfaces_in_the_caller_naming_the_file(tmp_path, kind):
    def fail(k, path, offset, nbytes):
        if k == kind and os.path.basename(path) == "bucket-2.swap":
            raise OSError(5, "Input/output error")

    staging = _staging(tmp_path, slots=2, hook=fail, timeout_s=5)
    staging.schedule(range(len(SIZES)))
    start = time.monotonic()
    with pytest.raises(SwapIOError, match=rf"the {kind} of bytes .* of .*bucket-2\.swap failed: OSError") as caught:
        for key in range(len(SIZES)):
            staging.acquire(key)
            staging.release(key)
    assert time.monotonic() - start < 5 and caught.value.path.endswith("bucket-2.swap")
    with pytest.raises(SwapIOError, match="bucket-2.swap"):  # broken from then on: every call says why
        staging.schedule([0])
    staging.close()  # already raised: close() cleans up without raising it twice
    assert not os.listdir(tmp_path)


def test_a_write_failure_nobody_waited_on_is_raised_by_close(tmp_path):
    def fail(kind, path, offset, nbytes):
        if kind == "write":
            raise OSError(28, "No space left on device")

    staging = _staging(tmp_path, slots=2, hook=fail)
    staging.schedule([0])
    staging.acquire(0)
    staging.release(0)
    with pytest.raises(SwapIOError, match=r"bucket-0\.swap failed: OSError: \[Errno 28\] No space left"):
        staging.close()
    assert not os.listdir(tmp_path)


def test_a_stalled_read_times_out_instead_of_hanging(tmp_path):
    release = threading.Event()

    def stall(kind, path, offset, nbytes):
        release.wait(5)

    staging = _staging(tmp_path, slots=1, hook=stall, timeout_s=0.3)
    staging.schedule([0])
    start = time.monotonic()
    with pytest.raises(SwapTimeoutError, match=r"bucket 0 \(.*bucket-0\.swap\) waited 0.3 s for its read"):
        staging.acquire(0)
    assert time.monotonic() - start < 2
    release.set()
    staging.close()
    assert not os.listdir(tmp_path)


def test_close_waits_for_the_writes_in_flight_then_removes_everything(tmp_path):
    written = []

    def slow_write(kind, path, offset, nbytes):
        if kind == "write":
            time.sleep(0.05)
            written.append(offset)

    staging = _staging(tmp_path, slots=2, hook=slow_write)
    folder = staging.files.folder.path
    staging.schedule([5])
    staging.acquire(5)
    staging.release(5)
    chunks = -(-_layout(SIZES[5]).nbytes // 8192)
    staging.close()
    assert len(written) == chunks  # every chunk of the write-back ran before the files went
    assert not os.path.exists(folder) and not os.listdir(tmp_path)
    staging.close()  # idempotent


def test_acquiring_a_bucket_still_held_is_refused_not_a_hang(tmp_path):
    staging = _staging(tmp_path, slots=2, timeout_s=5)
    staging.schedule([1, 1])
    staging.acquire(1)
    start = time.monotonic()
    with pytest.raises(StagingOrderError, match=r"acquire\(1\) while bucket 1 is still held: release it"):
        staging.acquire(1)
    assert time.monotonic() - start < 1  # refused at once, not after the timeout
    staging.release(1)
    staging.acquire(1)
    staging.release(1, dirty=False)
    staging.close()


def test_flush_waits_for_the_write_backs_then_the_files_hold_the_newest_values(tmp_path):
    def slow_write(kind, path, offset, nbytes):
        if kind == "write":
            time.sleep(0.05)

    staging = _staging(tmp_path, slots=2, hook=slow_write)
    staging.schedule([3, 4])
    for key in (3, 4):
        staging.acquire(key)["exp_avg_sq"].fill_(float(key))
        staging.release(key)
    staging.flush()
    assert staging.in_use == 0
    for key in (3, 4):
        assert staging.files[key].read_tensors()["exp_avg_sq"].eq(float(key)).all()
    staging.close()


def test_flush_raises_a_write_back_failure_naming_the_file(tmp_path):
    def fail(kind, path, offset, nbytes):
        if kind == "write":
            time.sleep(0.05)  # still in flight when flush() starts waiting
            raise OSError(5, "Input/output error")

    staging = _staging(tmp_path, slots=2, hook=fail)
    staging.schedule([0])
    staging.acquire(0)
    staging.release(0)
    with pytest.raises(SwapIOError, match=r"the write of bytes .* of .*bucket-0\.swap failed"):
        staging.flush()
    staging.close()
    assert not os.listdir(tmp_path)


def test_a_failed_read_is_raised_even_before_its_completion_callback_ran(tmp_path, monkeypatch):
    """A transfer is done (its event set) a moment before its callback records the failure: acquire must not take
    the half-read slot for data in that moment."""
    late = DiskStaging._read_done

    def slow_callback(self, transfer):
        time.sleep(0.3)
        late(self, transfer)

    monkeypatch.setattr(DiskStaging, "_read_done", slow_callback)

    def fail(kind, path, offset, nbytes):
        if kind == "read" and offset == 8192:  # the first chunk lands, the second fails
            raise OSError(5, "Input/output error")

    staging = _staging(tmp_path, slots=1, hook=fail, timeout_s=5)
    staging.schedule([1])
    assert staging._staged[1].read.done.wait(5)  # done; its callback still asleep
    with pytest.raises(SwapIOError, match=r"the read of bytes \[8192, 16384\) of .*bucket-1\.swap failed"):
        staging.acquire(1)
    staging.close()
