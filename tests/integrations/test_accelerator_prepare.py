"""`RoundPipeAccelerator.prepare` and friends: what comes back, where it lives, and the small promises."""

from __future__ import annotations

import logging

import torch
from integration_unit_helpers import CPU_WORKERS, float64_causal_lm_loss, lm_batch, tiny_llama, twin
from torch.utils.data import DataLoader, TensorDataset

from accelerate_roundpipe import RoundPipe, RoundPipeAccelerator, RoundPipePlugin


def make_accelerator(**kwargs) -> RoundPipeAccelerator:
    plugin = kwargs.pop("plugin", {})
    return RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**{**CPU_WORKERS, **plugin}), **kwargs)


def test_hf_model_comes_back_as_itself_with_batches_on_the_host():
    model = tiny_llama()
    accelerator = make_accelerator(gradient_accumulation_steps=4)
    loader = DataLoader(TensorDataset(torch.arange(8).view(4, 2)), batch_size=2)
    optimizer, prepared, loader = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1), model, loader)
    assert prepared is model and type(model).__name__ == "LlamaForCausalLM"  # optimizer first: still fine
    assert accelerator.device == torch.device("cpu")
    assert all(batch[0].device.type == "cpu" for batch in loader)
    engine = accelerator.roundpipe_engine(model)
    assert engine._deferred.expected_scale == 0.25  # backward divides by the 4 accumulation steps
    assert accelerator.unwrap_model(model) is model
    assert all(p.device.type == "cpu" for p in model.parameters())
    engine.close()


def test_sequential_becomes_the_engine():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = twin(layers)
    accelerator = make_accelerator()
    model, optimizer = accelerator.prepare(layers, torch.optim.SGD(layers.parameters(), lr=0.1))
    assert isinstance(model, RoundPipe) and accelerator.prepare(layers) is model  # converted once
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))  # forward pipeline + backward pipeline
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    reference_optimizer.step()
    unwrapped = accelerator.unwrap_model(model)
    assert unwrapped is layers
    for (name, p), q in zip(unwrapped.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    model.close()


def test_bf16_mixed_precision_becomes_bfloat16_compute_copies():
    accelerator = make_accelerator(mixed_precision="bf16")
    assert accelerator.roundpipe_plugin.param_dtype == torch.bfloat16 and accelerator.native_amp is False
    model = tiny_llama()
    model = accelerator.prepare(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in accelerator.roundpipe_engine(model).parameters()} == {torch.float32}
    accelerator.roundpipe_engine(model).close()


def test_short_last_batch_runs_with_fewer_microbatches(caplog):
    """[Note: short batches]: an explicit micro-batch count above a batch's rows is lowered for that batch only."""
    model = tiny_llama()
    reference = twin(model)
    accelerator = make_accelerator(plugin={"num_microbatches": 4})
    model = accelerator.prepare(model)
    engine = accelerator.roundpipe_engine(model)
    model.train()
    batch = lm_batch(rows=3)
    with caplog.at_level(logging.WARNING):
        loss = model(**batch).loss
        model(**lm_batch(rows=4)).loss.backward()
        model(**lm_batch(rows=2)).loss.backward()
    assert "shorter than num_microbatches=4" in caplog.text and caplog.text.count("Shown once") == 1
    assert engine.config.num_microbatches == 4
    torch.testing.assert_close(loss, reference(**batch).loss.detach(), atol=1e-5, rtol=0)
    engine.close()


def test_model_zero_grad_clears_the_engine_gradients():
    model = tiny_llama()
    accelerator = make_accelerator()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine = accelerator.roundpipe_engine(model)
    model.train()
    accelerator.backward(model(**lm_batch()).loss)
    engine.synchronize()
    assert any(p.grad is not None for p in engine.parameters())
    model.zero_grad()  # as transformers.Trainer clears gradients
    engine.synchronize()
    assert all(p.grad is None for p in engine.parameters())
    engine.close()


def test_model_state_dict_right_after_a_step_shows_the_newest_weights():
    """`model.state_dict()` of the prepared model (the same object), read right after `optimizer.step()` as a loop
    that saves with `torch.save(model.state_dict(), ...)` reads it, and PEFT's `get_peft_model_state_dict`, which
    calls it: the weights after the step, as the plain model gives. Before, they were the compute copies as the last
    look left them: the initial weights, 1e-2 off the plain model's after the first AdamW step."""
    import peft

    model, reference = tiny_llama().double(), tiny_llama().double()
    reference.loss_function = float64_causal_lm_loss  # HF's own casts the logits to float32; the engine's head does not
    accelerator = make_accelerator(plugin=dict(param_dtype=torch.float64))
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        accelerator.backward(model(**lm_batch(seed=step)).loss)
        optimizer.step()
        optimizer.zero_grad()
        reference(**lm_batch(seed=step)).loss.backward()
        plain.step()
        plain.zero_grad()
        got, want = model.state_dict(), reference.state_dict()
        worst = max(float((got[name] - want[name]).abs().max()) for name in want)
        assert worst < 1e-6, f"model.state_dict() after step {step + 1} is {worst:.3g} off the plain model's"
    accelerator.roundpipe_engine(model).close()

    base = tiny_llama().double()
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0, init_lora_weights=False))
    before = {n: v.clone() for n, v in peft.get_peft_model_state_dict(lora).items()}
    accelerator = make_accelerator(plugin=dict(param_dtype=torch.float64))
    lora = accelerator.prepare(lora)
    optimizer = accelerator.prepare(torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2))
    accelerator.backward(lora(**lm_batch()).loss)
    optimizer.step()
    optimizer.zero_grad()
    read = peft.get_peft_model_state_dict(lora)
    accelerator.roundpipe_engine(lora).synchronize()
    newest = peft.get_peft_model_state_dict(lora)
    assert max(float((read[n] - before[n]).abs().max()) for n in before) > 1e-3  # the step moved the adapters
    assert all(torch.equal(read[n], newest[n]) for n in newest), "get_peft_model_state_dict right after step()"
    accelerator.roundpipe_engine(lora).close()


def test_a_clip_on_every_micro_step_of_a_window_says_to_gate_it_on_sync_gradients():
    """A loop clipping on every micro-step of an accumulation window (accepted by plain Accelerate, where it clips the
    partial sums) is refused at the second clip, saying how to write it. Before, the message said "clip once per
    step" while the loop had called `optimizer.step()` after each micro-step (Accelerate skips the inner step)."""
    import pytest

    model = tiny_llama().double()
    accelerator = make_accelerator(gradient_accumulation_steps=2, plugin=dict(param_dtype=torch.float64))
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(RuntimeError, match=r"if accelerator.sync_gradients: accelerator.clip_grad_norm_"):
        for step in range(2):
            with accelerator.accumulate(model):
                accelerator.backward(model(**lm_batch(seed=step)).loss)
                accelerator.clip_grad_norm_(model.parameters(), 0.3)
                optimizer.step()
                optimizer.zero_grad()
    accelerator.roundpipe_engine(model).close()


def _train_step(accelerator, model, optimizer) -> float:
    loss = model(**lm_batch()).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_free_memory_lets_an_engine_go_once_the_caller_drops_its_model():
    """accelerate's `free_memory` releases every reference the accelerator keeps, the engines included: a loop that
    retries a smaller batch after running out of memory builds a new engine each time, and the old one (threads,
    pinned store, device state) must not live as long as the accelerator."""
    import gc
    import weakref

    accelerator = make_accelerator()
    model = tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train_step(accelerator, model, optimizer)
    engine = weakref.ref(accelerator.roundpipe_engine(model))
    model, optimizer = accelerator.free_memory(model, optimizer)
    assert model is None and optimizer is None
    gc.collect()
    assert engine() is None


def test_after_free_memory_the_same_model_prepared_again_trains_on_its_engine():
    """What `transformers.Trainer` does at the start of every `train()`: `free_memory()`, then `prepare` of the
    model it holds. The engine is the same and keeps training, equal to a run without the call."""
    reference_accelerator = make_accelerator()
    reference = tiny_llama()
    reference, reference_optimizer = reference_accelerator.prepare(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    expected = [_train_step(reference_accelerator, reference, reference_optimizer) for _ in range(3)]
    reference_accelerator.roundpipe_engine(reference).close()

    accelerator = make_accelerator()
    model = tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine = accelerator.roundpipe_engine(model)
    losses = [_train_step(accelerator, model, optimizer)]
    accelerator.free_memory()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert accelerator.roundpipe_engine(model) is engine
    losses += [_train_step(accelerator, model, optimizer) for _ in range(2)]
    assert losses == expected
    engine.close()
