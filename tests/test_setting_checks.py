"""Every `RoundPipeConfig` setting is checked when it is given, and a refusal names the knob as the user can set it
(the field, `--roundpipe_<field>`, `ROUNDPIPE_<FIELD>`) and the allowed range."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from unittest import mock

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig

HINTS = typing.get_type_hints(RoundPipeConfig)
NUMERIC_FIELDS = [f.name for f in dataclasses.fields(RoundPipeConfig)
                  if set(typing.get_args(HINTS[f.name])) & {int, float}]
# Out of range for every numeric setting, whatever its range: what passes these is checked per field below.
ALWAYS_BAD = [float("nan"), float("inf"), -1, "nan", "-5", "lots"]


def test_the_numeric_fields_are_found():
    assert {"num_microbatches", "wait_timeout_s", "peak_tflops", "gpu_memory_budget", "head_shards",
            "seed"} <= set(NUMERIC_FIELDS)


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
@pytest.mark.parametrize("bad", ALWAYS_BAD, ids=repr)
def test_every_numeric_field_refuses_what_cannot_work_at_construction(name, bad):
    """Before: wait_timeout_s=nan was accepted and disabled every timeout; 0 or -5 failed only at the first wait."""
    with mock.patch.dict(os.environ, {}, clear=True), pytest.raises(ValueError) as refused:
        RoundPipeConfig(**{name: bad})
    message = str(refused.value)
    assert name in message and f"--roundpipe_{name}" in message and f"ROUNDPIPE_{name.upper()}" in message, message
    assert "must be" in message, message  # the allowed range


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
def test_a_bad_environment_value_names_the_variable(name):
    with mock.patch.dict(os.environ, {f"ROUNDPIPE_{name.upper()}": "nan"}, clear=True), \
            pytest.raises(ValueError, match=f"ROUNDPIPE_{name.upper()}='nan'"):
        RoundPipeConfig()


@pytest.mark.parametrize("name,bad", [
    ("wait_timeout_s", 0), ("peak_tflops", 0), ("gpu_memory_budget", 0), ("head_shards", 0), ("num_microbatches", 0),
    ("microbatches_per_round", 0), ("mlp_chunk_tokens", 0), ("num_microbatches", 1.5), ("seed", 2 ** 64),
    ("async_warmup_steps", 0.5),
])
def test_zero_and_fractions_where_they_cannot_work(name, bad):
    with mock.patch.dict(os.environ, {}, clear=True), pytest.raises(ValueError, match=rf"{name}.*must be"):
        RoundPipeConfig(**{name: bad})


def test_values_in_range_pass_and_keep_their_types():
    with mock.patch.dict(os.environ, {}, clear=True):
        config = RoundPipeConfig(wait_timeout_s="0.5", peak_tflops=989, gpu_memory_budget="24GiB", head_shards="Auto",
                                 seed=0, async_warmup_steps="0", num_microbatches="4", mlp_chunk_tokens=2.0)
    assert config.wait_timeout_s == 0.5 and isinstance(config.wait_timeout_s, float)
    assert config.peak_tflops == 989.0 and config.gpu_memory_budget == 24.0 and config.head_shards == "auto"
    assert config.seed == 0 and config.async_warmup_steps == 0 and config.num_microbatches == 4
    assert config.mlp_chunk_tokens == 2 and isinstance(config.mlp_chunk_tokens, int)
    assert not math.isnan(config.wait_timeout_s)


@pytest.mark.parametrize("devices", ["cuda:0", ["cpu", "cuda:1"], "cuda"])
def test_cuda_devices_without_cuda_are_refused_at_construction(devices):
    """Before: accepted here and refused only when an engine was built (inside `train()` / `prepare`)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"devices \(env ROUNDPIPE_DEVICES\)=.* names CUDA devices, but"):
        RoundPipeConfig(devices=devices)
    with mock.patch.dict(os.environ, {"ROUNDPIPE_DEVICES": "cuda:0"}), \
            pytest.raises(ValueError, match="ROUNDPIPE_DEVICES"):
        RoundPipeConfig()


def test_a_device_index_beyond_the_visible_gpus_is_refused_at_construction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert RoundPipeConfig(devices="cuda:0,cuda:1").devices == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match=r"names cuda:2, but only 2 CUDA GPU\(s\) are visible"):
        RoundPipeConfig(devices="cuda:0,cuda:2")


@pytest.mark.parametrize("devices", ["tpu:0", "mps", "meta", "cpu,gpu0"])
def test_an_unknown_or_unsupported_device_type_names_the_setting(devices):
    """Before: torch's bare "Expected one of cpu, cuda, ... device type at start of device string" (a RuntimeError),
    or 'mps'/'meta' accepted and failing later."""
    with pytest.raises(ValueError, match=r"devices \(--roundpipe_devices, env ROUNDPIPE_DEVICES\).*'cuda:N'.*'cpu'"):
        RoundPipeConfig(devices=devices)


def test_pinned_memory_without_cuda_is_refused_at_construction():
    """Before: accepted here and refused only when an engine was built."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"pin_memory \(env ROUNDPIPE_PIN_MEMORY\) is true.*ROUNDPIPE_PIN_MEMORY=0"):
        RoundPipeConfig(devices=["cpu"], pin_memory=True)
    assert RoundPipeConfig(devices=["cpu"], pin_memory="0").pin_memory is False
