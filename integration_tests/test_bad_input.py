"""Bad input fails early and says which setting to change."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch
from roundpipe_testing import LOOP_SCRIPT, ROUNDPIPE_ENV, loop_args, run_in_process, run_subprocess, subprocess_env

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin, UnsupportedModelError


@pytest.mark.parametrize("variable,value,match", [
    ("ROUNDPIPE_NUM_MICROBATCH", "4", "did you mean ROUNDPIPE_NUM_MICROBATCHES"),
    ("ROUNDPIPE_ASYNC_OPTIMIZER", "maybe", "ROUNDPIPE_ASYNC_OPTIMIZER='maybe' is not a boolean"),
    ("ROUNDPIPE_DEVICES", "gpu0", "invalid RoundPipe setting"),
    ("ROUNDPIPE_RECOMPUTE", "block", "choose one of"),
])
def test_bad_roundpipe_variables_stop_the_launcher_before_the_script(tiny_assets, tmp_path, variable, value, match):
    env = {**ROUNDPIPE_ENV, variable: value}
    with pytest.raises(ValueError, match=match):
        run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, str(tmp_path), 2), roundpipe=True, env=env)
    assert not os.path.exists(os.path.join(tmp_path, "step_losses.json"))  # the script never started


def test_bad_variable_in_a_launched_process_exits_with_the_message(tiny_assets, tmp_path):
    env = subprocess_env(str(tmp_path), {**ROUNDPIPE_ENV, "ROUNDPIPE_DEVCES": "cpu,cpu"})
    with pytest.raises(AssertionError, match="did you mean ROUNDPIPE_DEVICES"):
        run_subprocess([sys.executable, "-m", "accelerate_roundpipe.run", LOOP_SCRIPT,
                        *loop_args(tiny_assets, str(tmp_path), 2)], env, timeout=120)


class NotADecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def test_a_model_that_cannot_be_split(tmp_path):
    """A model that is neither an HF decoder-only LM nor an nn.Sequential: the error names the way out."""
    with mock.patch.dict(os.environ, ROUNDPIPE_ENV):
        accelerator = RoundPipeAccelerator()
    with pytest.raises(UnsupportedModelError, match=r"nn\.Sequential.*|without RoundPipe") as error:
        accelerator.prepare(NotADecoder())
    assert "without RoundPipe" in str(error.value) and "nn.Sequential" in str(error.value)
    assert "the stock Accelerator or Trainer. To run this model anyway" in str(error.value)  # was "Trainer.. To run"
    assert ".." not in str(error.value)


def test_a_trainer_model_that_cannot_be_split(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    model = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=64))
    args = RoundPipeTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True,
                                      roundpipe_devices="cpu,cpu")
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    with pytest.raises(UnsupportedModelError, match="Cannot split BertForMaskedLM"):
        trainer.train()


def test_data_parallel_style_settings(tmp_path):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_roundpipe.launch.cli import main as cli

    with pytest.raises(ValueError, match="num_processes 1"):
        RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cpu"]),
                             fsdp_plugin=FullyShardedDataParallelPlugin())
    with mock.patch.dict(os.environ, ROUNDPIPE_ENV):
        accelerator = RoundPipeAccelerator()
    model = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="DataParallel.*ROUNDPIPE_DEVICES"):
        accelerator.prepare(model)
    # One process per GPU on one machine (every process would drive every GPU): refused before anything starts.
    for flags in (["--num_processes", "2"], ["--multi_gpu", "--num_processes", "4"]):
        with pytest.raises(SystemExit, match="per machine, each driving every visible GPU"):
            cli(["launch", "--roundpipe", *flags, LOOP_SCRIPT])
    config = tmp_path / "multi.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                      "mixed_precision: 'no'\nuse_cpu: false\ndebug: false\nroundpipe:\n  enabled: true\n")
    with pytest.raises(SystemExit, match="2 process.*on 1 machine.*one process per machine"):
        cli(["launch", "--config_file", str(config), LOOP_SCRIPT])


def test_data_parallel_style_trainer_arguments(tmp_path):
    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    for setting in ({"fsdp": "full_shard"}, {"torch_compile": True}):
        with pytest.raises(ValueError, match=f"`{next(iter(setting))}` is set"):
            args = RoundPipeTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **setting)
            RoundPipeTrainer(model=torch.nn.Linear(2, 2), args=args)


def _tiny_trainer(tmp_path, optimizers=(None, None), **args):
    from transformers import LlamaForCausalLM

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments
    from accelerate_roundpipe.tiny.data import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(64))
    values = dict(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, per_device_train_batch_size=2,
                  roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=2)
    values.update(args)
    data = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4
    return RoundPipeTrainer(model=model, args=RoundPipeTrainingArguments(**values), train_dataset=data,
                            optimizers=optimizers)


def test_a_trainer_optimizer_over_other_parameters_is_told_what_to_pass(tmp_path):
    """Before: told to call `accelerator.prepare`, which a Trainer user never calls."""
    other = torch.nn.Linear(3, 3)
    trainer = _tiny_trainer(tmp_path, optimizers=(torch.optim.SGD(other.parameters(), lr=0.1), None))
    with pytest.raises(ValueError, match=r"holds no parameter of a RoundPipe model.*passed as "
                                         r"`optimizers=\(optimizer, scheduler\)` must be built over the parameters "
                                         r"of the model passed as `model=`") as error:
        trainer.train()
    assert "accelerator.prepare" not in str(error.value)


def test_a_trainer_batch_smaller_than_num_microbatches_is_refused_before_training(tmp_path):
    """The docs call it an error, and it is one: every step's batch would be short ([Note: short batches])."""
    # The setting named where it was given (issue 31 item 8): the training argument, not the variable.
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=2 is smaller than the micro-batch count, "
                                         r"roundpipe_num_microbatches=4 \(a RoundPipeTrainingArguments field, "
                                         r"--roundpipe_num_microbatches\).*Set num_microbatches to at most 2 there, "
                                         r"or per_device_train_batch_size to at least 4") as error:
        _tiny_trainer(tmp_path, roundpipe_num_microbatches=4)
    assert "ROUNDPIPE_NUM_MICROBATCHES" not in str(error.value)
