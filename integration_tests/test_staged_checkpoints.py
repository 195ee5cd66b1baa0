"""Trainer checkpoints are written under a temporary name and renamed into place once complete
([Note: staged checkpoints]): a failure during step 8 leaves no `checkpoint-8/`, so `resume_from_checkpoint=True` takes
`checkpoint-4/`; rotation (`save_total_limit`) and best-model tracking come out as the plain Trainer's."""

from __future__ import annotations

import os

import pytest
import torch
from test_roundpipe_trainer import common_args, data, make_model, roundpipe_trainer  # noqa: F401 - `data`: a fixture
from transformers import TrainerCallback

from accelerate_roundpipe.runtime.common import faults

STEPS = 12


class _FaultAtStep(TrainerCallback):
    """Arms a fault for the optimizer step of step number `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, False

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 == self.step

    def hook(self, point: str) -> None:
        if self.armed and point == "optimizer.step":
            raise RuntimeError("injected optimizer failure at step 8")


def _checkpoints(out: str) -> list[str]:
    return sorted(os.listdir(out))


def _resume_from_last(data, out: str) -> None:  # noqa: F811 - `data` is the fixture's value
    resumed = roundpipe_trainer(data, out, max_steps=STEPS, save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    assert resumed.state.log_history[0]["step"] == 1 and len([e for e in resumed.state.log_history if "loss" in e]) \
        == STEPS  # steps 1-4 from checkpoint-4's state, then 5-12
    resumed.roundpipe_engine.close()


def test_a_failure_in_a_step_leaves_no_checkpoint_resume_would_pick(data, tmp_path):  # noqa: F811
    """Before: the fault surfaced inside the step-8 save and left an empty `checkpoint-8/`; resume then failed
    with "Can't find a valid checkpoint" instead of using checkpoint-4."""
    out = str(tmp_path / "run")
    fault = _FaultAtStep(8)
    trainer = roundpipe_trainer(data, out, max_steps=STEPS, save_strategy="steps", save_steps=4)
    trainer.add_callback(fault)
    with faults.injected(fault.hook), pytest.raises(RuntimeError, match="injected optimizer failure"):
        trainer.train()
    trainer.roundpipe_engine.close()
    assert _checkpoints(out) == ["checkpoint-4"]
    _resume_from_last(data, out)


def test_a_save_that_fails_midway_is_discarded(data, tmp_path, monkeypatch):  # noqa: F811
    """An error after the model was written (here: the RNG state) removes the partial checkpoint."""
    out = str(tmp_path / "run")
    trainer = roundpipe_trainer(data, out, max_steps=STEPS, save_strategy="steps", save_steps=4)
    original = type(trainer)._save_rng_state

    def save_rng_state(self, output_dir):
        if self.state.global_step == 8:
            assert os.path.isfile(os.path.join(output_dir, "model.safetensors"))  # the save is under way
            raise OSError("No space left on device")
        return original(self, output_dir)

    monkeypatch.setattr(type(trainer), "_save_rng_state", save_rng_state)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    trainer.roundpipe_engine.close()
    assert _checkpoints(out) == ["checkpoint-4"]
    monkeypatch.undo()
    _resume_from_last(data, out)


def test_rotation_and_best_model_as_the_plain_trainer(data, tmp_path):  # noqa: F811
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    tokenizer, train, held_out = data
    settings = dict(max_steps=8, save_strategy="steps", save_steps=2, save_total_limit=2, eval_strategy="steps",
                    eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    results, weights = {}, {}
    for name in ("plain", "roundpipe"):
        out = str(tmp_path / name)
        torch.manual_seed(0)
        if name == "plain":
            args = TrainingArguments(**common_args(out, **settings))
            trainer = Trainer(model=make_model(len(tokenizer)), args=args, train_dataset=train, eval_dataset=held_out)
        else:
            args = RoundPipeTrainingArguments(**common_args(out, **settings), roundpipe_devices="cpu,cpu",
                                              roundpipe_num_microbatches=2)
            trainer = RoundPipeTrainer(model=make_model(len(tokenizer)), args=args, train_dataset=train,
                                       eval_dataset=held_out)
        trainer.train()
        # greater_is_better on the loss: the best is the first evaluation, kept through the rotation.
        results[name] = (_checkpoints(out), os.path.basename(trainer.state.best_model_checkpoint))
        # the best weights loaded into the model are what it holds now ([Note: weight edits followed])
        weights[name] = {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
        if name == "roundpipe":
            trainer.roundpipe_engine.close()
    assert results["roundpipe"] == results["plain"]
    assert results["plain"][1] == "checkpoint-2" and "checkpoint-8" in results["plain"][0]
    for key, value in weights["plain"].items():
        torch.testing.assert_close(weights["roundpipe"][key], value, rtol=1e-3, atol=1e-4,
                                   msg=lambda m, key=key: f"{key}: {m}")
