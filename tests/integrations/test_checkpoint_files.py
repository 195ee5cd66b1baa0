"""Every file RoundPipe writes into a checkpoint, missing, truncated, garbage or inconsistent with the rest: loading
it raises `CheckpointError` naming the file, the checkpoint and what to do ([Note: checkpoint files])."""

from __future__ import annotations

import json
import os

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama

from accelerate_roundpipe import CheckpointError, RoundPipeAccelerator, RoundPipePlugin

ENGINE_STATE = "roundpipe_engine_state.json"
OPTIMIZER_COPIES = "roundpipe_optimizer_copies.safetensors"
LAGGED_WEIGHTS = "roundpipe_lagged_weights.safetensors"


def _trained_and_saved(directory: str):
    """bf16 compute copies and the lagged step: a checkpoint holding all three of RoundPipe's files."""
    plugin = dict(CPU_WORKERS, param_dtype="bfloat16", async_optimizer=True)
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**plugin))
    model = tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.train()
    for seed in (0, 1):
        accelerator.backward(model(**lm_batch(seed=seed)).loss)
        optimizer.step()
        optimizer.zero_grad()
    saved = accelerator.save_state(directory)
    assert {ENGINE_STATE, OPTIMIZER_COPIES, LAGGED_WEIGHTS} <= set(os.listdir(saved))
    return accelerator, model, str(saved)


def _inconsistent(name: str, path: str) -> None:
    """Readable, but not of this model and run."""
    from safetensors.torch import load_file, save_file

    if name == ENGINE_STATE:
        with open(path) as f:
            state = json.load(f)
        del state["seed"]
        with open(path, "w") as f:
            json.dump(state, f)
        return
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key] = torch.zeros(3)  # another model's shape
    save_file(tensors, path)


def _damage(name: str, path: str, how: str) -> None:
    if how == "missing":
        os.remove(path)
    elif how == "truncated":
        with open(path, "rb") as f:
            head = f.read()
        with open(path, "wb") as f:
            f.write(head[: len(head) // 3] if name != ENGINE_STATE else b"")
    elif how == "garbage":
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY not this file at all \xff\xfe")
    else:
        _inconsistent(name, path)


@pytest.mark.parametrize("how", ["missing", "truncated", "garbage", "inconsistent"])
@pytest.mark.parametrize("name", [ENGINE_STATE, OPTIMIZER_COPIES, LAGGED_WEIGHTS])
def test_a_damaged_roundpipe_file_names_itself_the_checkpoint_and_the_remedy(tmp_path, name, how):
    accelerator, model, saved = _trained_and_saved(str(tmp_path / "checkpoint"))
    _damage(name, os.path.join(saved, name), how)
    with pytest.raises(Exception) as raised:
        accelerator.load_state(saved)
    message = str(raised.value)
    assert name in message and saved in message, message
    assert "previous checkpoint" in message and "start" in message, message
    assert isinstance(raised.value, CheckpointError), repr(raised.value)
    accelerator.roundpipe_engine(model).close()


@pytest.mark.parametrize("name", [OPTIMIZER_COPIES, LAGGED_WEIGHTS])
def test_a_file_the_engine_state_does_not_list_is_refused(tmp_path, name):
    """Left from another save into the same directory: the engine state, written last, lists what belongs to it."""
    accelerator, model, saved = _trained_and_saved(str(tmp_path / "checkpoint"))
    path = os.path.join(saved, ENGINE_STATE)
    with open(path) as f:
        state = json.load(f)
    state["files"].remove(name)
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(CheckpointError, match="does not list it") as raised:
        accelerator.load_state(saved)
    assert name in str(raised.value) and saved in str(raised.value)
    accelerator.roundpipe_engine(model).close()
