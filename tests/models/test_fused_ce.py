"""`fused_linear_cross_entropy_sum` gives the loss and gradients of `F.cross_entropy(reduction="sum")` on the full
logits, and the head uses it exactly where the logits are a plain `nn.Linear` (else the checkpointed path)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.nn import functional

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.models import fused_ce, head, split_causal_lm
from accelerate_roundpipe.models.fused_ce import fused_linear_cross_entropy_sum

from split_helpers import (
    COMMON,
    assert_close,
    assert_same_gradients,
    build_model,
    gradients,
    lora_model,
    make_batch,
    reference_loss,
    run_layers,
)

TOKENS, HIDDEN, VOCAB = 24, 16, 40
# Upstream gradient of the loss (the engine's micro-batch weight, 1/num_items_in_batch): backward must scale by it.
UPSTREAM = 0.37


def make_inputs(dtype=torch.float64, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_()
    bias_ = torch.randn(VOCAB, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[8:16] = -100  # a whole chunk for chunk sizes 1, 4 and 8; part of one for the others
    labels[[2, 19]] = -100
    return hidden, weight, bias_, labels


def loss_and_grads(loss_fn, hidden, weight, bias, labels):
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    for tensor in tensors:
        tensor.grad = None
    loss = loss_fn(hidden, weight, bias, labels)
    (loss * UPSTREAM).backward()
    return loss.detach(), [None if t is None else t.grad for t in (hidden, weight, bias)]


def reference(hidden, weight, bias, labels):
    logits = functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def fused(chunk_tokens):
    return lambda hidden, weight, bias, labels: fused_linear_cross_entropy_sum(
        hidden, weight, labels, bias=bias, chunk_tokens=chunk_tokens
    )


def assert_all_close(actual, expected, atol):
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, atol=atol, rtol=0)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 5, 7, 8, TOKENS, 100])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_loss_and_gradients_equal_full_logits_cross_entropy(chunk_tokens, bias):
    inputs = make_inputs(bias=bias)
    expected_loss, expected_grads = loss_and_grads(reference, *inputs)
    loss, grads = loss_and_grads(fused(chunk_tokens), *inputs)
    torch.testing.assert_close(loss, expected_loss, atol=1e-10, rtol=0)
    assert_all_close(grads, expected_grads, atol=1e-10)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients():
    hidden, weight, bias, labels = make_inputs()
    labels[:] = -100
    loss, grads = loss_and_grads(fused(5), hidden, weight, bias, labels)
    assert loss.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in grads)


def test_frozen_weight_gets_no_gradient_and_no_weight_gradient_work(monkeypatch):
    hidden, weight, bias, labels = make_inputs()
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    expected_loss, expected_grads = loss_and_grads(reference, hidden, weight, bias, labels)
    monkeypatch.setattr(fused_ce, "_add_matmul", lambda *args: pytest.fail("weight gradient of a frozen head"))
    loss, grads = loss_and_grads(fused(5), hidden, weight, bias, labels)
    torch.testing.assert_close(loss, expected_loss, atol=1e-10, rtol=0)
    assert_all_close(grads, expected_grads, atol=1e-10)
    assert weight.grad is None and bias.grad is None


def test_hidden_without_grad_gets_only_weight_gradients(monkeypatch):
    hidden, weight, bias, labels = make_inputs()
    hidden.requires_grad_(False)
    expected_loss, expected_grads = loss_and_grads(reference, hidden, weight, bias, labels)
    real_mm = torch.mm

    def mm_without_out(*args, **kwargs):  # the hidden gradient is the only product written with out=
        assert "out" not in kwargs, "hidden gradient computed for a hidden state without grad"
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm_without_out)
    loss, grads = loss_and_grads(fused(5), hidden, weight, bias, labels)
    torch.testing.assert_close(loss, expected_loss, atol=1e-10, rtol=0)
    assert_all_close(grads, expected_grads, atol=1e-10)
    assert hidden.grad is None


def test_without_grad_mode_only_the_loss_is_computed(monkeypatch):
    hidden, weight, bias, labels = make_inputs()
    monkeypatch.setattr(
        fused_ce._FusedLinearCrossEntropySum, "apply", lambda *args: pytest.fail("gradients computed in no_grad")
    )
    with torch.no_grad():
        loss = fused_linear_cross_entropy_sum(hidden, weight, labels, bias=bias, chunk_tokens=5)
        expected = reference(hidden, weight, bias, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected, atol=1e-10, rtol=0)


def test_bf16_inputs_are_close_to_the_fp32_reference_and_to_plain_bf16_autograd():
    hidden, weight, bias, labels = make_inputs(torch.bfloat16)
    loss, grads = loss_and_grads(fused(5), hidden, weight, bias, labels)
    assert loss.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    plain_loss, plain_grads = loss_and_grads(reference, hidden, weight, bias, labels)  # bf16 matmuls, fp32 softmax
    as_fp32 = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    expected_loss, expected_grads = loss_and_grads(reference, *as_fp32, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for grad, plain, expected in zip(grads, plain_grads, expected_grads):
        assert_close(grad.float(), expected, "bf16 gradient vs fp32", rtol=2e-2)  # bf16 rounding: about 1e-2
        assert_close(grad.float(), plain.float(), "bf16 gradient vs plain bf16 autograd", rtol=1e-2)


def test_a_second_backward_is_refused():
    hidden, weight, bias, labels = make_inputs()
    loss = fused_linear_cross_entropy_sum(hidden, weight, labels, bias=bias)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


# ----------------------------------------------------------------------------- the head


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the head called the fused loss."""
    calls = []
    real = head.fused_linear_cross_entropy_sum
    monkeypatch.setattr(head, "fused_linear_cross_entropy_sum", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def head_loss_and_grads(model, split, batch, use_fused_loss: bool):
    split.layers[-1].use_fused_loss = use_fused_loss
    model.zero_grad()
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()
    return loss.detach(), gradients(model)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("gemma2", {"final_logit_softcapping": None}),
    ],
    ids=["llama", "qwen3", "qwen3-tied", "gemma2-without-softcapping"],
)
def test_head_fused_path_equals_checkpointed_path_and_hf(family, overrides, fused_calls):
    model = build_model(family, **overrides)
    batch = make_batch("right")
    split = split_causal_lm(model, loss_chunk_tokens=5)  # uneven chunks over 3 rows x 12 positions

    old_loss, old_grads = head_loss_and_grads(model, split, batch, use_fused_loss=False)
    assert not fused_calls
    lm_head_calls = []
    model.lm_head.register_forward_hook(lambda *args: lm_head_calls.append(1))
    loss, grads = head_loss_and_grads(model, split, batch, use_fused_loss=True)

    assert fused_calls and not lm_head_calls, "the head did not take the fused path"
    assert_close(loss, old_loss, "fused loss vs checkpointed loss")
    assert_same_gradients(grads, old_grads, float32_norms=family == "gemma2")
    assert_close(loss, reference_loss(model, batch).detach(), "fused loss vs HF")


def test_head_fused_path_without_grad_gives_the_same_loss(fused_calls):
    model = build_model("qwen3")
    batch = make_batch("mixed")
    split = split_causal_lm(model)
    with torch.no_grad():
        loss = run_layers(split.layers, split.prepare_inputs(**batch))
    assert fused_calls
    assert_close(loss, reference_loss(model, batch), "no-grad fused loss vs HF")


def build_from_config(config_name: str, model_name: str, **overrides):
    """A tiny random float64 model of a family `split_helpers.FAMILIES` does not list."""
    config = getattr(transformers, config_name)(**{**COMMON, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(torch.float64).train()


@pytest.mark.parametrize(
    "build",
    [
        lambda: build_model("gemma2"),  # final_logit_softcapping=3.0
        lambda: build_from_config("GraniteConfig", "GraniteForCausalLM", logits_scaling=4.0),
        lambda: build_from_config("CohereConfig", "CohereForCausalLM", logit_scale=0.25),
        lambda: pytest.importorskip("peft") and lora_model("llama", ["lm_head"]),  # a LoRA-wrapped head
    ],
    ids=["gemma2-softcapping", "granite-logits-scaling", "cohere-logit-scale", "lora-on-the-lm-head"],
)
def test_families_that_change_the_logits_take_the_checkpointed_path(build, fused_calls):
    model = build()
    batch = make_batch("right")
    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    assert not fused_calls
    assert_close(loss, reference_loss(model, batch), "loss vs HF")


def test_lora_elsewhere_uses_the_fused_path_with_a_frozen_head(fused_calls):
    pytest.importorskip("peft")
    peft_model = lora_model("qwen3", ["q_proj"])
    model = peft_model.get_base_model()
    batch = make_batch("mixed")
    split = split_causal_lm(peft_model)
    old_loss, old_grads = head_loss_and_grads(peft_model, split, batch, use_fused_loss=False)
    loss, grads = head_loss_and_grads(peft_model, split, batch, use_fused_loss=True)
    assert fused_calls and model.lm_head.weight.grad is None
    assert_close(loss, old_loss, "fused loss vs checkpointed loss")
    assert_same_gradients(grads, old_grads)


def test_engine_takes_the_fused_path_and_matches_hf(fused_calls):
    """Through `wrap_model`: the workers run the head on their own copy of it, with the weights bound per task."""
    model = build_model("qwen3", tie_word_embeddings=True)
    batch = make_batch("left")
    expected = reference_loss(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    model.zero_grad()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    try:
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        grads = {name: p.grad for name, p in engine.named_parameters()}
    finally:
        engine.close()
    assert len(fused_calls) == 3  # one per micro-batch
    assert_close(loss, expected.detach(), "loss")
    assert_same_gradients(grads, expected_grads)
