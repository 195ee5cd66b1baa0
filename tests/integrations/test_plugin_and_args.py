"""`RoundPipePlugin` and `RoundPipeTrainingArguments`: env defaults, checks, and agreement with `RoundPipeConfig`."""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, RoundPipePlugin, RoundPipeTrainingArguments
from accelerate_roundpipe.config import ENV_ALIASES
from accelerate_roundpipe.integrations.plugin import check_variable_names, known_variables
from accelerate_roundpipe.integrations.trainer import check_training_args
from accelerate_roundpipe.integrations.training_args import PREFIX, plugin_from_training_args

CONFIG_FIELDS = [f.name for f in dataclasses.fields(RoundPipeConfig)]


def test_plugin_is_a_config_filled_from_the_environment():
    env = {"ROUNDPIPE_DEVICES": "cpu,cpu", "ROUNDPIPE_NUM_MICROBATCHES": "6", "ROUNDPIPE_ASYNC_OPTIMIZER": "false"}
    with mock.patch.dict(os.environ, env):
        plugin = RoundPipePlugin()
        assert isinstance(plugin, RoundPipeConfig)
        assert plugin.devices == ["cpu", "cpu"] and plugin.num_microbatches == 6 and plugin.async_optimizer is False
        assert RoundPipePlugin(num_microbatches=2).num_microbatches == 2  # an argument beats the environment


def test_misspelt_variable_is_an_error_with_a_suggestion():
    assert set(known_variables()) >= {f"ROUNDPIPE_{f.upper()}" for f in CONFIG_FIELDS}
    with pytest.raises(ValueError, match=r"ROUNDPIPE_ASYNC_OPTIMISER \(did you mean ROUNDPIPE_ASYNC_OPTIMIZER\?\)"):
        check_variable_names({"ROUNDPIPE_ASYNC_OPTIMISER": "true"})
    check_variable_names({"ROUNDPIPE_DEVICES": "cpu", "OTHER": "1"})


@pytest.mark.parametrize("variable,value,match", [
    ("ROUNDPIPE_ASYNC_OPTIMIZER", "maybe", "not a boolean"),
    ("ROUNDPIPE_DEVICES", "gpu0", "invalid RoundPipe setting"),
    ("ROUNDPIPE_PARAM_DTYPE", "int8", "floating-point"),
])
def test_bad_values_say_where_settings_come_from(variable, value, match):
    with mock.patch.dict(os.environ, {variable: value}), pytest.raises(ValueError, match=match) as error:
        RoundPipePlugin()
    assert "ROUNDPIPE_* environment variables" in str(error.value)


def test_training_arguments_mirror_every_engine_field():
    fields = {f.name: f for f in dataclasses.fields(RoundPipeTrainingArguments)}
    doc = RoundPipeTrainingArguments.__doc__
    for name in CONFIG_FIELDS:
        argument = fields[PREFIX + name]
        assert argument.default is None, name  # None: defer to ROUNDPIPE_<FIELD>
        assert f"ROUNDPIPE_{name.upper()}" in argument.metadata["help"], name
        assert f"{PREFIX}{name} (env `ROUNDPIPE_{name.upper()}`)" in doc, name
    assert len([n for n in fields if n.startswith(PREFIX)]) == len(CONFIG_FIELDS)


def test_training_arguments_parse_and_become_a_plugin(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RoundPipeTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "true", "--roundpipe_devices", "cpu,cpu",
         "--roundpipe_async_optimizer", "false", "--roundpipe_num_microbatches", "3",
         "--roundpipe_param_dtype", "bfloat16"])
    assert args.place_model_on_device is False
    with mock.patch.dict(os.environ, {"ROUNDPIPE_NUM_MICROBATCHES": "8", "ROUNDPIPE_RECOMPUTE": "layer"}):
        plugin = plugin_from_training_args(args)
    assert plugin.devices == ["cpu", "cpu"] and plugin.async_optimizer is False
    assert plugin.num_microbatches == 3  # the flag beats the environment
    assert plugin.recompute == "layer"  # unset flags defer to the environment
    assert plugin.param_dtype == torch.bfloat16


def test_training_arguments_help_prints(capsys):
    """argparse %-formats each help text: a lone "%" in an engine field's help failed `--help` of every HF script."""
    from transformers import HfArgumentParser

    with pytest.raises(SystemExit) as exit_:
        HfArgumentParser(RoundPipeTrainingArguments).parse_args_into_dataclasses(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--{PREFIX}{name}" in out for name in CONFIG_FIELDS)


@pytest.mark.parametrize("settings", [RoundPipePlugin, RoundPipeConfig])
def test_plugin_and_config_build_an_hf_argument_parser(settings, capsys):
    """HF scripts build their parser from the dataclasses they are handed, and `HfArgumentParser` passes every key of
    a field's `metadata` but `aliases` to argparse's `add_argument`: a key argparse does not take (the variable
    aliases once kept there) failed the parser's construction."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(settings)
    (parsed,) = parser.parse_args_into_dataclasses(["--num_microbatches", "4", "--devices", "cpu", "cpu"])
    assert type(parsed) is settings
    assert parsed.num_microbatches == 4 and parsed.devices == ["cpu", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args_into_dataclasses(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "--num_microbatches" in help_text and "--trace_path" in help_text


def test_variable_aliases_are_read_and_known(tmp_path):
    """The aliases live in `ENV_ALIASES` beside the fields, not in their metadata; each names a field, is read as
    that field's variable (after ROUNDPIPE_<FIELD>), and is a known variable, not a misspelt one."""
    assert set(ENV_ALIASES) <= set(CONFIG_FIELDS)
    assert all(not set(f.metadata) - {"help"} for f in dataclasses.fields(RoundPipeConfig))  # argparse-safe
    trace = str(tmp_path / "trace.json")
    with mock.patch.dict(os.environ, {"ROUNDPIPE_TRACE": trace}):
        check_variable_names()
        assert RoundPipePlugin().trace_path == trace
    with mock.patch.dict(os.environ, {"ROUNDPIPE_TRACE": trace, "ROUNDPIPE_TRACE_PATH": trace + ".own"}):
        assert RoundPipePlugin().trace_path == trace + ".own"  # the field's own variable first
    assert "ROUNDPIPE_TRACE" in known_variables()


def fake_args(**values) -> SimpleNamespace:
    defaults = dict(world_size=1, n_gpu=1, _n_gpu=1, fsdp="", deepspeed=None, torch_compile=False, fp16=False,
                    gradient_checkpointing=False, activation_checkpointing=False)
    defaults.update(values)
    return SimpleNamespace(**defaults)


def test_one_process_drives_every_gpu(caplog):
    args = fake_args(n_gpu=4, _n_gpu=4)
    check_training_args(args)
    assert args._n_gpu == 1  # no DataParallel; train_batch_size is not multiplied by the GPU count
    # Several processes (one per machine) are accepted; the loss is then normalised by the global token count.
    args = fake_args(world_size=2, average_tokens_across_devices=False)
    with caplog.at_level(logging.WARNING):
        check_training_args(args)
    assert args.average_tokens_across_devices is True and "average_tokens_across_devices=True" in caplog.text
    with pytest.raises(ValueError, match="`deepspeed` is set"):
        check_training_args(fake_args(deepspeed="ds.json"))
    args = fake_args(gradient_checkpointing=True)
    with caplog.at_level(logging.WARNING):
        check_training_args(args)
    assert args.gradient_checkpointing is False and "recomputes activations itself" in caplog.text
