"""A notebook's or a sweep's Trainers in turn, as users write them (`trainer = RoundPipeTrainer(...)` then
`trainer.train()`, again): the previous Trainer, dropped, refers to itself, and its engine's optimizer state and
gradients must be back before the next engine allocates, or at once when the user closes the engine
([Note: memory freed at close])."""

from __future__ import annotations

import gc

import pytest
import torch
from test_roundpipe_trainer import roundpipe_trainer
from torch.multiprocessing.reductions import StorageWeakRef


@pytest.fixture
def data():
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train, held_out


def _state_storages(trainer) -> list[StorageWeakRef]:
    state = trainer.optimizer.state
    refs = [StorageWeakRef(v.untyped_storage()) for entry in state.values() for v in entry.values()
            if torch.is_tensor(v) and v.numel() > 1]
    assert refs
    return refs


def test_closing_a_held_trainers_engine_frees_its_state(data, tmp_path):
    """The notebook's way to get the memory back while `trainer` still names the old Trainer (the next Trainer is
    built before the name moves). Before: the optimizer state stayed as long as the Trainer."""
    trainer = roundpipe_trainer(data, str(tmp_path), max_steps=2)
    trainer.train()
    refs = _state_storages(trainer)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.roundpipe_engine.close()
    assert sum(not r.expired() for r in refs) == 0
    engine = trainer.roundpipe_engine
    assert all(torch.equal(engine._modules["module"].state_dict()[k], v) for k, v in weights.items())


def test_the_previous_trainers_state_is_freed_before_the_next_engine_allocates(data, tmp_path):
    """`trainer = RoundPipeTrainer(...)` then `trainer.train()`, twice: the first Trainer, dropped, is in its own
    cycles, and its state is back before the second engine allocates (the Trainer's `train()` collects, and so
    does a new engine: `engine_parts.collect_earlier_engines`)."""
    gc.collect()
    gc.disable()
    try:
        trainer = roundpipe_trainer(data, str(tmp_path), max_steps=2)
        trainer.train()
        first = _state_storages(trainer)
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        trainer = roundpipe_trainer(data, str(tmp_path), max_steps=2)  # the first one is garbage now
        assert sum(not r.expired() for r in first) == len(first)  # in its cycles: nothing freed it yet
        trainer.train()
        assert sum(not r.expired() for r in first) == 0
        assert [row["loss"] for row in trainer.state.log_history if "loss" in row] == losses
    finally:
        gc.enable()
        gc.collect()
