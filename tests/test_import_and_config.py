"""No work at import time; config fields, env variables and docs agree."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig


def test_import_starts_no_threads_and_touches_no_gpu():
    code = ("import threading, torch, accelerate_roundpipe; "
            "assert threading.active_count() == 1, threading.enumerate(); "
            "assert not torch.cuda.is_initialized(); print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "clean"


def test_env_fills_unset_fields_and_arguments_win():
    env = {"ROUNDPIPE_DEVICES": "cpu,cpu", "ROUNDPIPE_NUM_MICROBATCHES": "6", "ROUNDPIPE_ASYNC_OPTIMIZER": "false",
           "ROUNDPIPE_PARAM_DTYPE": "bf16", "ROUNDPIPE_RECOMPUTE": "Layer", "ROUNDPIPE_BACKWARD_STAGES": "2,3"}
    with mock.patch.dict(os.environ, env):
        config = RoundPipeConfig()
        assert config.devices == ["cpu", "cpu"] and config.num_microbatches == 6
        assert config.async_optimizer is False and config.param_dtype == torch.bfloat16
        assert config.recompute == "layer" and config.backward_stages == [2, 3]
        assert RoundPipeConfig(num_microbatches=2, async_optimizer=True).num_microbatches == 2
        assert RoundPipeConfig(async_optimizer=True).async_optimizer is True


def test_defaults_without_env():
    with mock.patch.dict(os.environ, {}, clear=True):
        config = RoundPipeConfig()
        assert config.resolved_async_optimizer is False and config.resolved_recompute == "stage"
        if not torch.cuda.is_available():
            assert [str(d) for d in config.resolved_devices()] == ["cpu"]


@pytest.mark.parametrize("field,value,match", [
    ("recompute", "block", "choose one of"),
    ("async_optimizer", "maybe", "not a boolean"),
    ("param_dtype", "int8", "floating-point"),
    ("num_microbatches", 0, ">= 1"),
    ("backward_stages", "2,0", "at least one layer"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        RoundPipeConfig(**{field: value})


def test_every_field_has_help_and_a_documented_env_variable():
    doc = RoundPipeConfig.__doc__
    for f in dataclasses.fields(RoundPipeConfig):
        assert f.metadata.get("help"), f.name
        assert f"{f.name} (" in doc and f"ROUNDPIPE_{f.name.upper()}" in doc, f.name


def test_configuration_page_lists_every_field():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(RoundPipeConfig):
        assert f"| `{f.name}` | `ROUNDPIPE_{f.name.upper()}`" in page, f.name


def test_kernels_choice_is_checked_and_liger_needs_gpus():
    import pytest

    from accelerate_roundpipe import RoundPipeConfig
    from accelerate_roundpipe.models.kernels import apply_fused_kernels

    with pytest.raises(ValueError, match="kernels"):
        RoundPipeConfig(kernels="triton")
    assert RoundPipeConfig(kernels=" Liger ").kernels == "liger"
    cpu = [torch.device("cpu")]
    assert apply_fused_kernels(torch.nn.Linear(2, 2), "auto", cpu) is False  # CPU workers: the model's own layers
    assert apply_fused_kernels(torch.nn.Linear(2, 2), "none", [torch.device("cuda", 0)]) is False
    with pytest.raises((ValueError, ImportError), match="kernels='liger'"):
        apply_fused_kernels(torch.nn.Linear(2, 2), "liger", cpu)


def test_gpu_memory_budget_units():
    import pytest

    from accelerate_roundpipe import RoundPipeConfig

    assert RoundPipeConfig(gpu_memory_budget="24GiB").gpu_memory_budget == 24.0
    assert RoundPipeConfig(gpu_memory_budget=" 12.5 GB").gpu_memory_budget == 12.5
    with pytest.raises(ValueError, match="GiB"):
        RoundPipeConfig(gpu_memory_budget="lots")
    with pytest.raises(ValueError, match="positive"):
        RoundPipeConfig(gpu_memory_budget=0)
