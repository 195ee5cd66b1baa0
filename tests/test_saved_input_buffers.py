"""[Note: saved inputs in pooled blocks]: saved layer inputs land in page-locked blocks of the store, in size classes
of an eighth of an octave; a block given back when its payload is collected is handed out again only once the last
copy that touched it (its download, then the upload that read it back) has completed; a pass's saved inputs reuse the
blocks of the pass before; after the measured pass and at close the free blocks go. The pool is off by default
(`saved_input_buffers.POOLED`) until measured on a GPU; these tests turn it on."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices import factory
from accelerate_roundpipe.runtime.devices.pinned import HostMemory
from accelerate_roundpipe.runtime.devices.stream_model import StreamModelDevice
from accelerate_roundpipe.runtime.state import saved_input_buffers
from accelerate_roundpipe.runtime.state.saved_input_buffers import SavedInputBuffers, block_size

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class RecordingMemory(HostMemory):
    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.given_back: list[int] = []

    def give_back(self, *buffers: torch.Tensor) -> None:
        self.given_back.extend(b.numel() for b in buffers)
        super().give_back(*buffers)


def test_block_sizes_waste_at_most_an_eighth_and_powers_of_two_fit_exactly():
    MiB = 2**20
    assert block_size(1) == block_size(4096) == 4096
    assert [block_size(n) for n in (80 * MiB, 128 * MiB, 160 * MiB, 100 * MiB)] == \
        [80 * MiB, 128 * MiB, 160 * MiB, 104 * MiB]  # torch's page-locked cache: 128, 128, 256, 128 MiB
    previous = 0
    for nbytes in range(4097, 3 * 2**20, 7919):
        size = block_size(nbytes)
        assert nbytes <= size <= nbytes * 9 / 8 + 1 and size >= previous
        previous = size


def test_a_block_is_reused_only_after_the_copy_that_last_touched_it():
    pool = SavedInputBuffers(RecordingMemory())
    like = torch.empty(8, 1024, dtype=torch.bfloat16)  # 16 KiB
    lease = pool.lease()
    first = pool.host_copy_target(like, lease)
    assert first.shape == like.shape and first.dtype == like.dtype
    block = first.untyped_storage().data_ptr()
    upload = FakeEvent(done=False)
    lease.touched_by(upload)  # the upload that reads it back, still in flight
    del first
    gc.collect()
    assert pool.out_bytes == 0 and pool.free_bytes() == block_size(like.numel() * 2)
    second = pool.host_copy_target(like, pool.lease())
    assert second.untyped_storage().data_ptr() != block  # the upload may still read the first block
    assert pool.allocated == 2
    upload.done = True
    third = pool.host_copy_target(like, pool.lease())
    assert third.untyped_storage().data_ptr() == block and pool.allocated == 2
    del second, third


def test_a_smaller_input_reuses_the_smallest_larger_free_block():
    pool = SavedInputBuffers(RecordingMemory())
    big = pool.host_copy_target(torch.empty(8192, dtype=torch.float32), pool.lease())  # 32 KiB
    middle = pool.host_copy_target(torch.empty(4096, dtype=torch.float32), pool.lease())  # 16 KiB
    big_block, middle_block = (t.untyped_storage().data_ptr() for t in (big, middle))
    del big, middle
    gc.collect()
    small = pool.host_copy_target(torch.empty(3000, dtype=torch.float32), pool.lease())  # 12,000 B
    assert small.untyped_storage().data_ptr() == middle_block and pool.allocated == 2
    tiny = pool.host_copy_target(torch.empty(1500, dtype=torch.float32), pool.lease())  # 6,000 B: the 32 KiB one
    assert tiny.untyped_storage().data_ptr() == big_block and pool.allocated == 2
    del small, tiny


def test_inputs_that_grow_get_power_of_two_blocks_and_the_pool_holds_about_what_torchs_cache_would():
    """Where a request outgrows the free blocks (they are smaller) the new block is a power of two, so the next,
    larger inputs reuse it. Passes of 72 inputs of 4 rows x L tokens x 256 hidden, the pool beside a model of
    torch's power-of-two cache."""
    def torch_cache(lengths):
        free, made = {}, 0
        for length in lengths:
            size = 1 << (4 * length * 256 * 2 - 1).bit_length()
            held = []
            for _ in range(72):
                if free.get(size):
                    held.append(free[size].pop())
                else:
                    made += size
                    held.append(size)
            for block in held:
                free.setdefault(block, []).append(block)
        return made

    def pool_bytes(lengths):
        pool = SavedInputBuffers(RecordingMemory())
        for length in lengths:
            like = torch.empty(4 * length * 256, dtype=torch.bfloat16)
            held = [pool.host_copy_target(like, pool.lease()) for _ in range(72)]
            del held
            gc.collect()
        return pool.bytes

    assert pool_bytes([96, 96]) == 72 * block_size(4 * 96 * 256 * 2)  # a fixed shape: exact blocks, reused
    growing = list(range(40, 129, 2))  # 80 to 256 KiB a block
    # at most the first shape's exact blocks more (outgrown at once: the measured pass's go back in the engine)
    assert torch_cache(growing) < pool_bytes(growing) <= torch_cache(growing) + 72 * block_size(4 * 40 * 256 * 2)
    assert pool_bytes([128] * 4) <= torch_cache([128] * 4)


def test_release_idle_lets_go_of_the_free_blocks_and_keeps_those_held():
    memory = RecordingMemory()
    pool = SavedInputBuffers(memory)
    held = pool.host_copy_target(torch.empty(4096, dtype=torch.float32), pool.lease())
    dropped = pool.host_copy_target(torch.empty(2048, dtype=torch.float32), pool.lease())
    del dropped
    gc.collect()
    assert pool.release_idle() == 8192 and memory.given_back == [8192]
    assert pool.bytes == pool.out_bytes == 16384 and pool.free_bytes() == 0
    del held


@pytest.fixture
def stream_model(monkeypatch):
    """CPU workers that keep CUDA's stream order, and the pool on (off by default until measured on a GPU)."""
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    monkeypatch.setattr(saved_input_buffers, "POOLED", True)


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_saved_inputs_round_trip_through_the_pool_and_its_blocks_are_reused(stream_model, recompute):
    """Every pass saves layer inputs on the host (two workers, backward stages) and hands activations from one
    worker to the other through it; later passes reuse the first's blocks (how many are out at once depends on the
    threads' timing, so a few more may be made, never a pass's worth each pass), each block went back with the
    upload that read it, and the gradients are plain PyTorch's."""
    model = tied_model()
    x, mask, y = batch(rows=7)
    ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y)
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3, seed=0, plan="static",
                                              forward_stages=[2, 3], backward_stages=[2, 3, 4],
                                              recompute=recompute))
    try:
        pool = engine.host_store.saved_input_buffers
        leases = []
        original = pool.lease

        def recorded_lease():
            leases.append(original())
            return leases[-1]

        pool.lease = recorded_lease
        for step in range(6):
            engine.zero_grad(set_to_none=True)
            loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            engine.synchronize()
            if step == 0:
                made = pool.allocated
                assert made > 0 and leases
            assert_close(loss, ref_loss, 1e-12, "loss")
            for name, p in engine.named_parameters():
                assert_close(p.grad, ref_grads[name], 1e-12, f"grad of {name}")
        assert pool.allocated < 2 * made  # six passes made fewer blocks than two passes' worth: reused
        view = engine.snapshot().store  # what telemetry and the benchmark records read
        assert view.saved_input_pool_bytes == pool.bytes > 0 and view.saved_input_pool_peak_bytes == pool.peak_bytes
        gc.collect()
        assert pool.out_bytes == 0  # every saved input was read back and its block given back
        streams = {lease.event.stream.name for lease in leases}
        assert streams == {"activation upload"}  # each block's last copy: the upload that read it back
    finally:
        engine.close()


def test_torch_s_page_locked_cache_is_used_when_the_pool_is_off(monkeypatch):
    monkeypatch.setattr(saved_input_buffers, "POOLED", False)
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, plan="static",
                                                     backward_stages=[2, 3, 4]))
    try:
        assert engine.host_store.saved_input_buffers is None
        assert engine.snapshot().store.saved_input_pool_bytes is None
        x, mask, y = batch(rows=6)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
    finally:
        engine.close()


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_training_with_the_pool_follows_the_staleness_rule(monkeypatch, async_optimizer):
    """The exact and the lagged step, dropout replayed in the recomputation, three workers and the measured re-plan,
    with every saved input in the pool: the weights and losses of plain PyTorch (the pool changes where inputs
    wait, never what they hold: [Note: saved inputs in pooled blocks])."""
    import test_training

    monkeypatch.setattr(saved_input_buffers, "POOLED", True)
    test_training.test_steps_follow_the_staleness_rule(async_optimizer, True, "measured", 3)


def test_a_block_given_back_while_the_pool_is_locked_does_not_wait_for_the_lock():
    """A finalizer may run inside the garbage collector while its thread holds the pool's lock (an allocation in
    `_take`); it files the block back without the lock, and the next holder takes it in."""
    import threading

    pool = SavedInputBuffers(RecordingMemory())
    block = pool._take(4096)  # a block out of the pool, as a payload holds it
    with pool._lock:  # as inside _take
        giver = threading.Thread(target=pool._give, args=(block, pool.lease()))
        giver.start()
        giver.join(timeout=5)
        assert not giver.is_alive()
    assert pool.free_bytes() == 4096 and pool.out_bytes == 0
