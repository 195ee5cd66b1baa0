"""A refused setting is named where it was given ([Note: settings checked where given]): the variable, the key of a
config file's `roundpipe:` section with the file's path, the `RoundPipeTrainingArguments` field, the flag as the
command that took it spells it. A Python argument keeps the generic name (field, flag and variable). The Python API
raises `SettingError`, a ValueError."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, RoundPipePlugin, RoundPipeTrainingArguments
from accelerate_roundpipe.config import SettingError
from accelerate_roundpipe.launch import cli, config_file

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _refusal(call, *args, **kwargs) -> str:
    with pytest.raises(SettingError) as refused:
        call(*args, **kwargs)
    assert isinstance(refused.value, ValueError)  # `except ValueError` in callers keeps working
    return str(refused.value)


def _launch_config(tmp_path, section: dict) -> str:
    path = str(tmp_path / "c.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=True),
                              "roundpipe": {"enabled": True, **section}}, path)
    return path


def _launch(argv: list[str]) -> None:
    with mock.patch("accelerate.commands.launch.launch_command", lambda args: None):
        cli.launch_command(argv)


def test_a_config_files_value_is_named_by_its_key_and_file(tmp_path):
    """Before: "ROUNDPIPE_NUM_MICROBATCHES='zero' in the environment", a variable the user never set."""
    path = _launch_config(tmp_path, {"devices": "cpu", "num_microbatches": "zero"})
    message = _refusal(_launch, ["--config_file", path, "train.py"])
    assert message == (f"`num_microbatches: zero` in the `roundpipe:` section of {path}: num_microbatches must be an "
                       f"integer >= 1."), message
    assert "ROUNDPIPE_NUM_MICROBATCHES" not in os.environ  # refused before anything was exported


def test_a_variable_already_set_beats_the_file_and_is_named_as_the_variable(tmp_path):
    path = _launch_config(tmp_path, {"devices": "cpu", "num_microbatches": 2})
    with mock.patch.dict(os.environ, {"ROUNDPIPE_NUM_MICROBATCHES": "zero"}):
        message = _refusal(_launch, ["--config_file", path, "train.py"])
    assert "ROUNDPIPE_NUM_MICROBATCHES='zero': num_microbatches must be an integer >= 1" in message, message
    assert f"section of {path}" not in message


@needs_no_cuda
def test_cuda_devices_in_a_config_file_get_the_fix_in_the_files_spelling(tmp_path):
    path = _launch_config(tmp_path, {"devices": "cuda:0,cuda:1"})
    message = _refusal(_launch, ["--config_file", path, "train.py"])
    assert message.startswith(f"`devices: cuda:0,cuda:1` in the `roundpipe:` section of {path} names CUDA devices, "
                              f"but this PyTorch was built without CUDA"), message
    assert "`devices: cpu,cpu`" in message and "ROUNDPIPE_DEVICES" not in message, message


def test_an_unknown_key_names_the_file(tmp_path):
    path = _launch_config(tmp_path, {"num_microbatch": 2})
    message = _refusal(_launch, ["--config_file", path, "train.py"])
    assert message.startswith(f"unknown key `num_microbatch` in the `roundpipe:` section of {path} (did you mean "
                              f"`num_microbatches`?)"), message


def test_a_missing_config_file_is_a_setting_error(tmp_path):
    """Before: a FileNotFoundError traceback."""
    path = str(tmp_path / "missing.yaml")
    assert _refusal(_launch, ["--config_file", path, "train.py"]).startswith(f"--config_file {path}: no such file")


@pytest.mark.parametrize("flags,message", [
    (["--num_microbatches", "0"], "--num_microbatches 0: num_microbatches must be an integer >= 1."),
    (["--wait_timeout_s", "-5"], "--wait_timeout_s -5: wait_timeout_s must be a positive, finite number of seconds."),
    (["--recompute", "whole"], "--recompute whole: choose one of ['stage', 'layer']."),
])
def test_the_config_command_names_its_own_flags(tmp_path, flags, message):
    """Before: `num_microbatches (--roundpipe_num_microbatches, env ROUNDPIPE_NUM_MICROBATCHES) must be ...`."""
    assert _refusal(cli.config_command, ["--config_file", str(tmp_path / "c.yaml"), *flags]) == message


@needs_no_cuda
def test_the_config_command_gives_the_cuda_fix_in_its_own_flag(tmp_path):
    message = _refusal(cli.config_command, ["--config_file", str(tmp_path / "c.yaml"), "--devices", "cuda:0"])
    assert message.startswith("--devices cuda:0 names CUDA devices") and "--devices cpu,cpu" in message, message
    assert "--roundpipe_devices" not in message and "ROUNDPIPE_DEVICES" not in message, message


def _args(tmp_path, **roundpipe):
    return RoundPipeTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **roundpipe)


def test_a_training_argument_is_named_as_the_field(tmp_path):
    """Before: `num_microbatches (--roundpipe_num_microbatches, env ROUNDPIPE_NUM_MICROBATCHES)`, naming a variable
    that was not set."""
    message = _refusal(_args, tmp_path, roundpipe_num_microbatches=0)
    assert message == ("roundpipe_num_microbatches=0 (a RoundPipeTrainingArguments field, "
                       "--roundpipe_num_microbatches): num_microbatches must be an integer >= 1."), message
    message = _refusal(_args, tmp_path, roundpipe_async_optimizer="maybe")
    assert message.startswith("roundpipe_async_optimizer='maybe' (a RoundPipeTrainingArguments field, "
                              "--roundpipe_async_optimizer) is not a boolean"), message


@needs_no_cuda
def test_a_training_arguments_cuda_fix_is_in_the_fields_spelling(tmp_path):
    message = _refusal(_args, tmp_path, roundpipe_devices="cuda:0")
    assert message.startswith("roundpipe_devices='cuda:0' (a RoundPipeTrainingArguments field, --roundpipe_devices) "
                              "names CUDA devices"), message
    assert "roundpipe_devices='cpu,cpu'" in message and "ROUNDPIPE_DEVICES" not in message, message


def test_a_training_argument_left_unset_is_named_as_the_variable(tmp_path):
    with mock.patch.dict(os.environ, {"ROUNDPIPE_NUM_MICROBATCHES": "0"}):
        message = _refusal(_args, tmp_path)
    assert "ROUNDPIPE_NUM_MICROBATCHES='0': num_microbatches must be an integer >= 1" in message, message
    assert "RoundPipeTrainingArguments field" not in message


def test_the_engine_keeps_where_a_setting_was_given(tmp_path):
    """What a later check (the Trainer's batch against num_microbatches) names the setting by."""
    from accelerate_roundpipe.integrations.training_args import plugin_from_training_args

    plugin = plugin_from_training_args(_args(tmp_path, roundpipe_num_microbatches=4, roundpipe_devices="cpu"))
    assert plugin.setting_as_given("num_microbatches") == ("roundpipe_num_microbatches=4 (a RoundPipeTrainingArguments "
                                                          "field, --roundpipe_num_microbatches)")
    with mock.patch.dict(os.environ, {"ROUNDPIPE_NUM_MICROBATCHES": "6"}):
        assert RoundPipeConfig().setting_as_given("num_microbatches") == "ROUNDPIPE_NUM_MICROBATCHES='6'"
    assert RoundPipeConfig(num_microbatches=3).setting_as_given("num_microbatches") == (
        "num_microbatches (--roundpipe_num_microbatches, env ROUNDPIPE_NUM_MICROBATCHES)=3")


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:0", "cpu,cpu:1", ["cpu", torch.device("cpu", 1)]])
def test_a_cpu_worker_with_an_index_is_refused_with_the_spelling(devices):
    """Before: 'cpu:1' was accepted and ran as 'cpu' (a CPU worker has no index), while the launcher's
    one-process-per-machine check took it for a GPU."""
    message = _refusal(RoundPipeConfig, devices=devices)
    assert "CPU workers are written 'cpu', one entry per worker (e.g. 'cpu,cpu' for two)" in message, message
    with mock.patch.dict(os.environ, {"ROUNDPIPE_DEVICES": "cpu:1"}):
        message = _refusal(RoundPipePlugin)
    assert "ROUNDPIPE_DEVICES='cpu:1'" in message and "ROUNDPIPE_DEVICES='cpu,cpu'" in message, message
    assert RoundPipeConfig(devices=["cpu", torch.device("cpu")]).devices == ["cpu", "cpu"]
