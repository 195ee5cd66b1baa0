"""`wrap_model`: a Hugging Face causal LM on the engine, equal to the model's own forward/backward."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, UnsupportedModelError, wrap_model

from split_helpers import assert_close, build_model, make_batch, reference_loss

CONFIG = dict(devices=["cpu", "cpu"], num_microbatches=3)


def hf_reference(model, batch):
    ref = copy.deepcopy(model)
    loss = reference_loss(ref, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_forward_backward_equals_hf(tied):
    model = build_model("llama", tie_word_embeddings=tied)
    batch = make_batch("left")
    ref_loss, ref_grads = hf_reference(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    assert engine.module is model and type(model).__name__ == "LlamaForCausalLM"
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss, "loss")
    names = [n for n, _ in engine.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]  # HF names: optimizer groups by name keep working
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name], f"grad of {name}")
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert sum(len(b.layers) > 1 for b in engine._store.buckets) == 1
    engine.close()


def test_patched_model_call_in_a_stock_loop():
    model = build_model("qwen3")
    batch = make_batch("right")
    ref_loss, ref_grads = hf_reference(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    model.train()
    out = model(**batch)
    assert out.logits is None and out.loss.requires_grad
    assert_close(out.loss.detach(), ref_loss, "loss")
    (out.loss / 2).backward()
    engine.synchronize()
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name] / 2, f"grad of {name}")
    optimizer.step()
    optimizer.zero_grad()
    engine.synchronize()
    moved = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    expected = dict(engine.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(moved, expected.to(moved.dtype))  # the HF object shows the stepped weights
    engine.close()
    assert "forward" not in model.__dict__  # close() gives the model its own forward back


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_model_zero_grad_clears_the_engines_gradients(with_optimizer):
    """A stock loop zeroing through the model (`model.zero_grad()`, as the Trainer and many loops do): the gradients
    live on `engine.parameters()`, so nn.Module's own zero_grad cleared nothing and every step's gradients summed
    silently (3 SGD steps: 0.39 relative off plain PyTorch's weights). Through wrap_model alone, with and without
    a wrapped optimizer; close() gives the model its own zero_grad back."""
    model = build_model("qwen3")
    reference = copy.deepcopy(model)
    batches = [make_batch("right", seed=seed) for seed in range(3)]
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    if with_optimizer:
        optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for batch in batches:
            model(**batch).loss.backward()
            optimizer.step()
            model.zero_grad()
            reference_loss(reference, batch).backward()
            ref_optimizer.step()
            reference.zero_grad()
        engine.synchronize()
        for name, p in model.named_parameters():
            assert_close(p, dict(reference.named_parameters())[name], f"{name} after 3 steps")
    else:
        model(**batches[0]).loss.backward()
        model.zero_grad(set_to_none=False)
        model(**batches[1]).loss.backward()
        engine.synchronize()
        _, expected = hf_reference(reference, batches[1])
        for name, p in engine.named_parameters():
            assert_close(p.grad, expected[name], f"grad of {name}: the second batch's only")
    engine.close()
    assert "zero_grad" not in model.__dict__


def test_eval_logits_and_loss_and_grad_without_labels():
    model = build_model("mistral")
    batch = make_batch("left")
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref_out = ref(**batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert_close(out.logits, ref_out.logits, "logits")
    assert_close(out.loss, ref_out.loss, "eval loss", rtol=1e-6)  # HF computes its loss in float32
    model.train()
    unlabeled = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**unlabeled).logits
    logits.square().mean().backward()  # any function of the logits: the backward pipeline
    ref.train()
    ref(**unlabeled).logits.square().mean().backward()
    engine.synchronize()
    ref_grads = dict(ref.named_parameters())
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name].grad, f"grad of {name}")
    engine.close()


def test_generate_gives_the_models_tokens():
    model = build_model("llama")
    ref = copy.deepcopy(model).eval()
    prompt = torch.randint(0, 100, (2, 5))
    expected = ref.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    model.eval()
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0), expected)
    engine.close()


def test_peft_lora_steps_only_adapters_and_saves_them(tmp_path):
    peft = pytest.importorskip("peft")
    base = build_model("llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    batch = make_batch("right")
    ref_loss, ref_grads = hf_reference(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    trainable = [n for n, p in engine.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(b.optim is None for b in engine._store.buckets if not b.trainable)
    optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad],
                                                         lr=1e-2))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss, "loss")
    for name, p in engine.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, ref_grads[name], f"grad of {name}")
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer.step()
    model.save_pretrained(tmp_path)  # synchronizes first
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert (tmp_path / "adapter_model.safetensors").exists() and not (tmp_path / "model.safetensors").exists()
    engine.close()


def test_unsupported_model_and_unsupported_arguments():
    with pytest.raises(UnsupportedModelError, match="nn.Sequential"):
        wrap_model(torch.nn.Linear(3, 3))
    engine = wrap_model(build_model("llama"), RoundPipeConfig(**CONFIG))
    batch = make_batch("none")
    with pytest.raises(ValueError, match="output_attentions"):
        engine.module(**batch, output_attentions=True)
    with pytest.raises(TypeError, match="keyword arguments"):
        engine.forward_backward(batch["input_ids"])
    engine.close()


@pytest.mark.parametrize("cache_limit", [None, 0])
def test_captured_layer_arguments_hold_no_activations(monkeypatch, cache_limit):
    """The per-layer cache of captured arguments keeps the rotary tables and masks, never a micro-batch's hidden
    state, and nothing at all over `CAPTURE_CACHE_MAX_BYTES` (very long sequences); the results do not change."""
    from accelerate_roundpipe.models import layers

    if cache_limit is not None:
        monkeypatch.setattr(layers, "CAPTURE_CACHE_MAX_BYTES", cache_limit)
    model = build_model("llama")
    batch = make_batch("none")
    ref_loss, ref_grads = hf_reference(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss, "loss")
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name], f"grad of {name}")
    caches = [c.module._captured for w in engine._dispatch.workers for c in w.residency.copies.values()
              if isinstance(c.module, layers.DecoderLayer)]
    assert caches
    if cache_limit == 0:
        assert all(not cache for cache in caches)
    else:
        entries = [entry for cache in caches for entry in cache.values()]
        assert entries and all((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]) is None
                               for args, kwargs in entries)
    engine.close()
