"""[Note: saved inputs in host memory]: before a pass of a new shape, the least its saved inputs put in host memory
is compared with what the host has available, and a pass that would not fit is warned about with its numbers and
what to change; the count is rows x tokens x hidden x the element size per saved layer, less what the device keeps."""

from __future__ import annotations

import logging

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig
from accelerate_roundpipe.integrations.convert import wrap_model
from accelerate_roundpipe.runtime.execution.saved_input_room import SavedInputRoom

transformers = pytest.importorskip("transformers")

HIDDEN, LAYERS = 16, 4


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32,
                                    num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                    max_position_embeddings=64)


def test_the_count_is_rows_tokens_hidden_and_bytes_per_saved_layer_less_what_the_device_keeps():
    room = SavedInputRoom(_config(), element_size=2, on_host=False)
    each = 8 * 32 * HIDDEN * 2
    assert room.host_bytes([4, 4], 32, saved_layers=3, keep_limit_bytes=0) == 3 * each
    assert room.host_bytes([4, 4], 32, saved_layers=3, keep_limit_bytes=each) == 2 * each
    assert room.host_bytes([4, 4], 32, saved_layers=3, keep_limit_bytes=10 * each) == 0
    on_cpu = SavedInputRoom(_config(), element_size=2, on_host=True)  # CPU workers: all of it is host memory
    assert on_cpu.host_bytes([4, 4], 32, saved_layers=3, keep_limit_bytes=10 * each) == 3 * each


def test_a_module_without_a_decoder_config_is_not_checked():
    room = SavedInputRoom(None, element_size=2, on_host=True, available=lambda: 0)
    room.check([4], (torch.zeros(4, 32, dtype=torch.long),), frozenset({1, 2}), 0, "stage")
    assert room.warnings == []


def _engine(backward_stages):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False,
                                               plan="static", backward_stages=backward_stages))
    return engine


@pytest.mark.parametrize("backward_stages", [[1, 1, 1, 1, 1, 1], [2, 2, 2]])
def test_a_pass_that_would_not_fit_is_warned_about_once_per_shape(backward_stages, caplog):
    engine = _engine(backward_stages)
    try:
        room = engine._launch.saved_room
        saved = engine._launch.partition.saved_input_layers("stage", fused=True) - {0}  # 0: the token ids
        assert len(saved) == len(backward_stages) - 2  # the first layer of each backward stage below the fused one
        need = 8 * 32 * HIDDEN * 4 * len(saved)  # float32 compute copies on CPU workers
        room.available = lambda: need - 1
        ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
        with caplog.at_level(logging.WARNING):
            engine.forward_backward(input_ids=ids, labels=ids)
            engine.forward_backward(input_ids=ids, labels=ids)  # the same shape: said once
        assert len(room.warnings) == 1
        message = room.warnings[0]
        assert f"the inputs of {len(saved)} layers" in message and "8 rows x 32 tokens x 16 hidden" in message
        assert "per_device_train_batch_size" in message and "host_memory_budget" in message
        assert message in caplog.text
        room.available = lambda: need  # it fits: a new shape that fits says nothing
        short = ids[:, :16]
        engine.forward_backward(input_ids=short, labels=short)
        assert len(room.warnings) == 1
    finally:
        engine.close()


def test_on_gpus_the_count_is_what_torchs_page_locked_cache_allocates():
    """[Note: saved inputs in the start summary]: a saved input downloaded from a GPU is a block of torch's caching
    host allocator, rounded up to a power of two; CPU workers hold them at their size."""
    from accelerate_roundpipe.runtime.execution.saved_input_room import pinned_block_bytes

    assert [pinned_block_bytes(n) for n in (0, 1, 4096, 4097, 80 * 2**20, 160 * 2**20)] == \
        [0, 1, 4096, 8192, 128 * 2**20, 256 * 2**20]
    room = SavedInputRoom(_config(), element_size=2, on_host=False, resident=lambda: 2**30)
    block = 4 * 40 * HIDDEN * 2  # 5,120 bytes a micro-batch: an 8 KiB block
    assert room.block_bytes([4, 4], 40) == [block, block]
    assert room.host_bytes([4, 4], 40, saved_layers=3, keep_limit_bytes=0) == 6 * block
    assert room.allocated_bytes([4, 4], 40, saved_layers=3, keep_limit_bytes=0) == 6 * 8192
    assert room.allocated_bytes([4, 4], 40, saved_layers=3, keep_limit_bytes=10**9) == 0  # all kept on the device
    line = room.summary_line([4, 4], 40, 3, 0, "stage", free=2**31)
    assert line.startswith("saved inputs: 3 layer inputs a pass for the backward's recomputation "
                           "(recompute='stage'), each 8 rows x 40 tokens x 16 hidden in 2 micro-batch block(s) of "
                           "5.000 KiB; ")
    assert "at least 30.000 KiB of them in host memory (48.000 KiB as torch's page-locked cache allocates them: " \
           "8.000 KiB a block)" in line
    assert "pinned_max_round_threshold_mb" not in line  # unsafe alone: [Note: unrounded page-locked blocks]
    assert line.endswith("outside host_memory_budget; this process is resident at 1.000 GiB, 2.000 GiB available")
    exact = room.summary_line([4, 4], 32, 3, 0, "stage", free=2**31)  # 4,096-byte blocks: nothing rounded
    assert "page-locked" not in exact and "at least 24.000 KiB of them in host memory, outside" in exact
    assert "all kept on the device" in room.summary_line([4, 4], 40, 3, 10**9, "stage", free=2**31)
    cpu = SavedInputRoom(_config(), element_size=2, on_host=True, resident=lambda: None)
    assert cpu.allocated_bytes([4, 4], 40, 3, 0) == 6 * block
    line = cpu.summary_line([4, 4], 40, 3, 0, "stage", free=2**31)
    assert "page-locked" not in line and line.endswith("outside host_memory_budget, 2.000 GiB available")


def test_the_first_pass_and_each_larger_shape_print_their_saved_inputs_beside_the_summary(capsys):
    """Once for the first shape, then only for a shape that keeps a quarter more: a Trainer padding each batch to its
    longest row would otherwise print a line nearly every step."""
    torch.manual_seed(0)
    engine = wrap_model(transformers.LlamaForCausalLM(_config()),
                        RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, plan="static",
                                        backward_stages=[1, 1, 1, 1, 1, 1]))
    try:
        saved = len(engine._launch.partition.saved_input_layers("stage", fused=True) - {0})
        ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
        capsys.readouterr()
        engine.forward_backward(input_ids=ids, labels=ids)
        engine.forward_backward(input_ids=ids, labels=ids)  # the same shape: said once
        engine.forward_backward(input_ids=ids[:, :16], labels=ids[:, :16])  # smaller: nothing new to say
        longer = torch.randint(0, 64, (8, 40), generator=torch.Generator().manual_seed(1))
        engine.forward_backward(input_ids=longer[:, :36], labels=longer[:, :36])  # 1.125x the first: not yet
        engine.forward_backward(input_ids=longer, labels=longer)  # 1.25x the first: said again
        err = capsys.readouterr().err
        snapshot = engine.snapshot()  # what telemetry and the benchmark records read
        assert snapshot.saved_input_lines == tuple(engine._launch.saved_room.lines)
        assert snapshot.saved_input_host_bytes == 2 * saved * 4 * 40 * HIDDEN * 4  # the 40-token shape's
    finally:
        engine.close()
    lines = [line for line in err.splitlines() if "saved inputs:" in line]
    assert len(lines) == 2 and lines == [f"[roundpipe]   {line}" for line in engine._launch.saved_room.lines]
    each = 4 * 32 * HIDDEN * 4  # float32 compute copies on CPU workers, 4 rows a micro-batch
    assert f"saved inputs: {saved} layer inputs a pass" in lines[0]
    assert "each 8 rows x 32 tokens x 16 hidden in 2 micro-batch block(s) of 8.000 KiB" in lines[0]
    assert f"at least {2 * saved * each / 1024:.3f} KiB of them in host memory, outside host_memory_budget" in lines[0]
    assert "this process is resident at " in lines[0] and lines[0].endswith(" available")
    assert "8 rows x 40 tokens x 16 hidden" in lines[1]
    assert err.index("(ROUNDPIPE_SUMMARY=0 hides this summary)") < err.index("saved inputs:")  # after the summary
