"""fp16/fp8 are refused for what they need (a loss scaler or an fp8 recipe), which neither step mode applies: the
message must not blame the lagged step, which is not the default (the exact step is)."""

from types import SimpleNamespace

import pytest

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
from accelerate_roundpipe.integrations.trainer import check_training_args


def test_trainer_fp16_refusal_names_loss_scaling_not_the_lagged_step():
    args = SimpleNamespace(world_size=1, n_gpu=1, _n_gpu=1, fsdp="", deepspeed=None, torch_compile=False, fp16=True,
                           gradient_checkpointing=False, activation_checkpointing=False)
    with pytest.raises(ValueError) as error:
        check_training_args(args)
    message = str(error.value)
    assert "loss scaling" in message and "bf16" in message and "Unset `fp16`" in message
    assert "lagged" not in message, message


def test_accelerator_fp16_refusal_names_loss_scaling_not_the_lagged_step():
    with pytest.raises(ValueError) as error:
        RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cpu"]), mixed_precision="fp16", cpu=True)
    message = str(error.value)
    assert "mixed_precision='fp16'" in message and "loss scaling" in message and "bf16" in message
    assert "lagged" not in message, message
