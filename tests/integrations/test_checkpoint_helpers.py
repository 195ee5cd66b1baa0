"""Checkpoints of RoundPipe models: copies out of the host store, loads through the engine, exact optimizer copies
with low-precision compute copies, and accelerate's save_state/load_state round trip."""

from __future__ import annotations

import os

import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipeConfig, RoundPipePlugin, wrap_model
from accelerate_roundpipe.integrations.checkpoint import (
    OPTIMIZER_COPIES_FILE,
    EngineWeights,
    detached_state_dict,
    has_low_precision_compute,
)


def test_detached_state_dict_copies_once_and_keeps_ties():
    model = tiny_llama(tie_word_embeddings=True)
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    state = detached_state_dict(engine)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # tied weights stay one tensor
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storages) == len({id(t) for t in state.values()})  # nothing else shares a storage
    live = model.state_dict()
    for name, tensor in live.items():
        assert torch.equal(state[name], tensor)
        assert state[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), name  # a copy
    engine.close()


def test_engine_weights_load_refreshes_the_optimizer_copies():
    model, donor = tiny_llama(), tiny_llama(seed=5)
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    EngineWeights(engine).load_state_dict(donor.state_dict())
    for name, p in engine.named_parameters():
        assert torch.equal(p, donor.state_dict()[name]), name
    engine.close()


def _train_steps(accelerator, model, optimizer, seeds):
    model.train()
    for seed in seeds:
        accelerator.backward(model(**lm_batch(seed=seed)).loss)
        optimizer.step()
        optimizer.zero_grad()


def test_save_state_load_state_round_trip_with_bfloat16_compute_copies(tmp_path):
    """With bf16 compute copies the saved model weights are rounded; the fp32 optimizer copies ride along, so a
    loaded run continues from exactly the same values (and optimizer state)."""
    plugin = dict(CPU_WORKERS, param_dtype="bfloat16", async_optimizer=True)
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**plugin))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = accelerator.roundpipe_engine(model)
    assert has_low_precision_compute(engine)
    _train_steps(accelerator, model, optimizer, [0, 1])
    saved = accelerator.save_state(str(tmp_path / "checkpoint"))
    assert os.path.isfile(os.path.join(saved, OPTIMIZER_COPIES_FILE.format(suffix="")))
    copies = {n: p.detach().clone() for n, p in engine.named_parameters()}
    optimizer_state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    _train_steps(accelerator, model, optimizer, [2, 3])  # move away, then come back

    accelerator.load_state(saved)
    for name, p in engine.named_parameters():
        assert torch.equal(p, copies[name]), name  # exact fp32 values, not the rounded model weights
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, copies[name].to(torch.bfloat16)), name
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, optimizer_state[key]), key
    engine.close()


def test_float32_checkpoints_hold_no_optimizer_copies(tmp_path):
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**CPU_WORKERS))
    model = tiny_llama(tie_word_embeddings=True)  # accelerate saves the tied weight once, and loads it back
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train_steps(accelerator, model, optimizer, [0])
    saved = accelerator.save_state(str(tmp_path / "checkpoint"))
    # Only the engine's RNG/dispatch state: float32 model weights are exact, so no optimizer copies are written.
    assert [name for name in os.listdir(saved) if name.startswith("roundpipe_")] == ["roundpipe_engine_state.json"]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_steps(accelerator, model, optimizer, [1])
    accelerator.load_state(saved)
    engine = accelerator.roundpipe_engine(model)
    for name, p in engine.named_parameters():
        assert torch.equal(p, weights[name]), name
    engine.close()
