"""Settings are checked where they are given: `RoundPipePlugin(...)` and `RoundPipeTrainingArguments(...)` refuse
what an engine could not run at construction, before a script goes on to load or tokenize anything."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from accelerate_roundpipe import RoundPipePlugin, RoundPipeTrainingArguments

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _args(tmp_path, **roundpipe):
    return RoundPipeTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **roundpipe)


@needs_no_cuda
def test_plugin_refuses_cuda_devices_without_cuda():
    with pytest.raises(ValueError, match=r"devices \(env ROUNDPIPE_DEVICES\)='cuda:0' names CUDA devices.*"
                                         r"ROUNDPIPE_\* environment variables"):
        RoundPipePlugin(devices="cuda:0")


@needs_no_cuda
def test_training_arguments_refuse_cuda_devices_without_cuda(tmp_path):
    """Before: accepted; refused only inside `Trainer.train()` (after run_clm.py had tokenized its data)."""
    with pytest.raises(ValueError, match=r"roundpipe_devices='cuda:0'.*names CUDA devices.*--roundpipe_devices"):
        _args(tmp_path, roundpipe_devices="cuda:0")
    with mock.patch.dict(os.environ, {"ROUNDPIPE_DEVICES": "cuda:0"}), \
            pytest.raises(ValueError, match=r"ROUNDPIPE_DEVICES.*names CUDA devices"):
        _args(tmp_path)
    assert _args(tmp_path, roundpipe_devices="cpu,cpu").roundpipe_devices == "cpu,cpu"


@needs_no_cuda
def test_parsed_training_arguments_refuse_cuda_devices_without_cuda(tmp_path):
    from transformers import HfArgumentParser

    with pytest.raises(ValueError, match=r"roundpipe_devices='cuda:0'.*names CUDA devices"):
        HfArgumentParser(RoundPipeTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "true",
             "--roundpipe_devices", "cuda:0"])


@pytest.mark.parametrize("name,bad", [("wait_timeout_s", float("nan")), ("peak_tflops", -1.0), ("head_shards", "0"),
                                      ("gpu_memory_budget", "-2GiB"), ("num_microbatches", 0)])
def test_training_arguments_refuse_numbers_out_of_range(tmp_path, name, bad):
    with pytest.raises(ValueError, match=rf"roundpipe_{name}=.* \(a RoundPipeTrainingArguments field, "
                                         rf"--roundpipe_{name}\): {name} must be") as refused:
        _args(tmp_path, **{f"roundpipe_{name}": bad})
    assert "ROUNDPIPE_" not in str(refused.value)  # the field was given, not the variable
    with pytest.raises(ValueError, match=rf"{name} \(--roundpipe_{name}, env ROUNDPIPE_{name.upper()}\) must be"):
        RoundPipePlugin(**{name: bad})
