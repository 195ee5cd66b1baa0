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
