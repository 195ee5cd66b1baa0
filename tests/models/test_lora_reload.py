"""PEFT LoRA on the engine: only the adapters get gradients (equal to plain PEFT's), and the adapters saved after
training reload onto a fresh base model and give the trained model's logits (float64, 1e-10)."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import assert_close, build_model, lora_model, make_batch, reference_loss

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]
LR = 1e-2
STEPS = 3


def adapter_names(model) -> list[str]:
    return [name for name, p in model.named_parameters() if "lora_" in name]


@pytest.mark.parametrize(("family", "targets", "devices", "num_mb", "labels"), [
    ("llama", TARGETS, 2, 3, True),
    ("llama", TARGETS, 1, 2, False),
    ("qwen3", [*TARGETS, "gate_proj", "lm_head"], 2, 2, True),  # LoRA on any linear, the head's included
])
def test_only_adapter_gradients_and_they_equal_plain_peft(family, targets, devices, num_mb, labels):
    model = lora_model(family, targets)
    ref = copy.deepcopy(model)
    batch = make_batch("left")
    if labels:
        expected_loss = reference_loss(ref, batch)
        expected_loss.backward()
    else:
        unlabeled = {k: v for k, v in batch.items() if k != "labels"}
        ref(**unlabeled).logits.square().mean().backward()
    expected = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    assert sorted(expected) == sorted(adapter_names(ref))  # plain PEFT: adapters only
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in expected} == set(targets)

    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * devices, num_microbatches=num_mb))
    assert engine.module is model and isinstance(model, peft.PeftModel)
    model.train()
    if labels:
        loss = engine.forward_backward(**batch)
        assert_close(loss, expected_loss.detach(), "loss")
    else:
        model(**unlabeled).logits.square().mean().backward()
    engine.synchronize()

    with_grad = {name: p.grad for name, p in engine.named_parameters() if p.grad is not None}
    assert sorted(with_grad) == sorted(adapter_names(model)), "gradients on non-adapter parameters"
    assert all(p.requires_grad == ("lora_" in name) for name, p in engine.named_parameters())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the user's object too
    for name, grad in with_grad.items():
        assert_close(grad, expected[name], f"grad of {name}")
    # Frozen base weights: one copy on the host, no optimizer copy, no gradient buffer.
    frozen = [b for b in engine._store.buckets if not b.trainable]
    assert frozen and all(b.optim is None for b in frozen)
    engine.close()


def _train(model, step_fn) -> None:
    for step in range(STEPS):
        step_fn(make_batch("right" if step % 2 else "left", seed=step))


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_adapters_saved_after_training_reload_with_the_trained_logits(tmp_path, async_optimizer):
    family = "llama"
    model = lora_model(family, TARGETS)
    ref = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    engine = wrap_model(
        model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3, async_optimizer=async_optimizer)
    )
    optimizer = engine.wrap_optimizer(
        torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=LR)
    )
    model.train()

    def engine_step(batch):
        model(**batch).loss.backward()  # the patched forward of a stock loop
        optimizer.step()
        optimizer.zero_grad()

    _train(model, engine_step)
    engine.synchronize()

    # Only the adapters moved; the base stayed bit-identical.
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("lora_" in name), f"{name}: changed={changed}"

    if not async_optimizer:  # without the one-step lag, the trajectory is plain PEFT's with plain AdamW
        ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)

        def ref_step(batch):
            reference_loss(ref, batch).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()

        _train(ref, ref_step)
        trained = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            assert_close(trained[name].detach(), p.detach(), f"{name} after {STEPS} steps vs plain PEFT")

    batch = make_batch("left", seed=10)
    model.eval()
    with torch.no_grad():
        trained_logits = model(**batch).logits  # through the engine
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists() and not (tmp_path / "model.safetensors").exists()
    engine.close()
    with torch.no_grad():
        own_logits = model(**batch).logits  # the model's own forward again, with the trained weights
    assert_close(own_logits, trained_logits, "the trained model's own logits vs the engine's")

    fresh_base = build_model(family).eval()
    with torch.no_grad():
        base_logits = fresh_base(**batch).logits
    reloaded = peft.PeftModel.from_pretrained(fresh_base, tmp_path).eval()
    saved = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), saved[name].detach()), f"{name} differs after reload"
    with torch.no_grad():
        reloaded_logits = reloaded(**batch).logits
    assert_close(reloaded_logits, trained_logits, "logits of the reloaded adapters")
    assert (reloaded_logits - base_logits).abs().max() > 1e-3, "the adapters changed nothing: the check is empty"
