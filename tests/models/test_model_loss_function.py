"""[Note: the model's own loss function]: `wrap_model` directly (float64, two CPU workers) with a loss the model's
forward computes through `self.loss_function` other than transformers' `ForCausalLMLoss`: every way HF lets a user
set one gives the plain model's loss and gradients (training through `model(**batch)` and `forward_backward`, the
evaluation loss); a class whose `forward` overrides the transformers class's is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from accelerate_roundpipe import RoundPipeConfig, UnsupportedModelError, wrap_model

from split_helpers import assert_close, assert_same_gradients, build_model, lora_model, make_batch

CONFIG = dict(devices=["cpu", "cpu"], num_microbatches=3, summary=False)


def tripled(*args, **kwargs):
    """3 x the causal-LM loss: what HF computes when it is set (it cannot pass for the plain loss)."""
    return 3 * ForCausalLMLoss(*args, **kwargs)


def smoothed(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """Not a multiple of the plain loss: label smoothing 0.2 over the shifted labels, by keyword as HF passes them."""
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab_size), shift, ignore_index=-100,
                                             label_smoothing=0.2, reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else (shift != -100).sum())


class TripledLossLlama(LlamaForCausalLM):
    """A subclass giving its own loss through the `loss_function` property (its forward is Llama's)."""

    @property
    def loss_function(self):
        return tripled


def with_own_loss(way: str, monkeypatch) -> torch.nn.Module:
    """A tiny float64 Llama whose forward computes another loss than ForCausalLMLoss, set the way `way` names."""
    if way == "subclass property":
        plain = build_model("llama")
        model = TripledLossLlama(plain.config).to(torch.float64)
        model.load_state_dict(plain.state_dict())
        return model.train()
    model = build_model("llama")
    if way == "loss_function":
        model.loss_function = tripled
    elif way == "smoothing loss_function":
        model.loss_function = smoothed
    elif way == "loss_type":
        model.loss_type = "ForMaskedLM"  # HF's masked-LM loss: the logits against the unshifted labels
    elif way == "LOSS_MAPPING":
        monkeypatch.setitem(LOSS_MAPPING, "ForCausalLM", tripled)
    return model


def hf_loss_and_grads(model, batch, **kwargs):
    reference = copy.deepcopy(model)
    loss = reference(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}


def engine_grads(engine) -> dict:
    engine.synchronize()
    return {n: p.grad for n, p in engine.named_parameters() if p.grad is not None}


WAYS = ["loss_function", "smoothing loss_function", "loss_type", "LOSS_MAPPING", "subclass property"]


@pytest.mark.parametrize("way", WAYS)
def test_the_model_call_computes_the_models_own_loss(way, monkeypatch):
    """`model(**batch).loss` and its backward in training, and the evaluation loss, are the plain model's."""
    model = with_own_loss(way, monkeypatch)
    batch = make_batch("left")
    expected_loss, expected_grads = hf_loss_and_grads(model, batch)
    with torch.no_grad():
        expected_eval = copy.deepcopy(model).eval()(**batch).loss
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    out = model(**batch)
    # HF's loss functions upcast the logits to float32 only: the loss is float32 rounding of the same value.
    assert_close(out.loss.detach(), expected_loss, "loss", rtol=1e-6)
    (out.loss / 2).backward()
    assert_same_gradients(engine_grads(engine), {n: g / 2 for n, g in expected_grads.items()}, rtol=1e-6)
    model.eval()
    with torch.no_grad():
        assert_close(model(**batch).loss, expected_eval, "evaluation loss", rtol=1e-6)
    engine.close()


def test_forward_backward_computes_the_models_own_loss():
    """`engine.forward_backward(**batch)` (one process) back-propagates the model's own loss, scaled by
    `grad_scale`, and returns it; `num_items_in_batch` reaches the function as HF's forward passes it."""
    model = build_model("llama")
    model.loss_function = tripled
    batch = make_batch("mixed")
    expected_loss, expected_grads = hf_loss_and_grads(model, batch, num_items_in_batch=torch.tensor(40))
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    loss = engine.forward_backward(**batch, num_items_in_batch=torch.tensor(40), grad_scale=0.5)
    assert loss.grad_fn is None
    assert_close(loss, expected_loss, "loss", rtol=1e-6)
    assert_same_gradients(engine_grads(engine), {n: g / 2 for n, g in expected_grads.items()}, rtol=1e-6)
    engine.close()


def test_a_loss_function_set_after_wrapping_counts():
    model = build_model("qwen3")
    batch = make_batch("right")
    reference = copy.deepcopy(model)
    reference.loss_function = tripled
    expected_loss, expected_grads = hf_loss_and_grads(reference, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    model.loss_function = tripled
    out = model(**batch)
    out.loss.backward()
    assert_close(out.loss.detach(), expected_loss, "loss", rtol=1e-6)
    assert_same_gradients(engine_grads(engine), expected_grads, rtol=1e-6)
    engine.close()


def test_mixture_of_experts_own_loss_keeps_the_router_aux_loss():
    """Qwen3-MoE with `output_router_logits`: the model's own loss plus HF's router aux loss of the whole batch."""
    model = build_model("qwen3_moe")
    model.loss_function = tripled
    batch = make_batch("left")
    expected_loss, expected_grads = hf_loss_and_grads(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    out = model(**batch)
    out.loss.backward()
    assert_close(out.loss.detach(), expected_loss, "loss", rtol=1e-6)
    assert_same_gradients(engine_grads(engine), expected_grads, rtol=1e-6)
    engine.close()


def test_peft_base_models_own_loss():
    """A LoRA model: the loss function set on the transformers model under PEFT, where HF's forward reads it."""
    model = lora_model("llama", ["q_proj", "v_proj"])
    model.get_base_model().loss_function = tripled
    batch = make_batch("left")
    expected_loss, expected_grads = hf_loss_and_grads(model, batch)
    engine = wrap_model(model, RoundPipeConfig(**CONFIG))
    out = model(**batch)
    out.loss.backward()
    assert_close(out.loss.detach(), expected_loss, "loss", rtol=1e-6)
    assert_same_gradients(engine_grads(engine), expected_grads, rtol=1e-6)
    engine.close()


class ZLossLlama(LlamaForCausalLM):
    """A forward of the user's own: the causal-LM loss plus a z-loss on the logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()
        return out


def test_a_class_overriding_forward_is_refused():
    plain = build_model("llama")
    model = ZLossLlama(plain.config).to(torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"ZLossLlama\.forward` overrides `LlamaForCausalLM\.forward`.*"
                                                    r"never calls it.*model\.loss_function = fn"):
        wrap_model(model, RoundPipeConfig(**CONFIG))
    assert "forward" not in vars(model)  # refused before anything was patched
