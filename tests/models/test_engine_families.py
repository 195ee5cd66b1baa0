"""Every family on the engine (`wrap_model`, CPU workers): loss, eval logits and every gradient equal the plain HF
model's own forward/backward, in float64 to 1e-10.

The matrix: padding (left, right) x labels (with, without) x devices (1, 2 CPU workers) x micro-batches (1, 2, 3).
Llama runs all of it; every other family runs a pairwise-covering subset (`PAIRWISE`: each pair of values of any two
axes appears at least once), which keeps the file fast while every axis meets every family.

Exceptions, each forced by the model rather than the engine:
- Gemma2 needs eager attention (attention soft-capping), whose fully padded query rows of a left-padded float64
  batch are NaN in HF itself; Gemma2 uses unpadded batches where the matrix says "left".
- Gemma2/3 RMSNorms compute in float32 even in a float64 model, so norm-weight gradients (summed over tokens whose
  grouping depends on the micro-batches) get a float32 tolerance of 1e-6; everything else stays at 1e-10.
- MoE families (Qwen3-MoE, GPT-OSS): HF's router aux loss is a product of two whole-batch means and does not split
  into a sum over micro-batches (see [Note: router statistics]). The aux loss is therefore checked exactly with one
  micro-batch, and the multi-micro-batch cases run with `output_router_logits=False`.
- HF computes its own `.loss` from logits cast to float32; the eval loss is compared to it at 1e-6 (and the float64
  loss of the fused pass to a float64 recomputation of HF's loss at 1e-10).
"""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import (
    FLOAT32_NORM_FAMILIES,
    MOE_FAMILIES,
    assert_close,
    assert_same_gradients,
    available_families,
    build_model,
    make_batch,
    reference_loss,
)

ISSUE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "gpt_oss")
FAMILIES = [family for family in ISSUE_FAMILIES if family in available_families()]

FULL = [
    (padding, labels, devices, num_mb)
    for padding in ("left", "right")
    for labels in (True, False)
    for devices in (1, 2)
    for num_mb in (1, 2, 3)
]
# Pairwise covering of the four axes in six cases.
PAIRWISE = [
    ("left", True, 1, 1),
    ("right", False, 2, 1),
    ("left", False, 2, 2),
    ("right", True, 1, 2),
    ("left", True, 2, 3),
    ("right", False, 1, 3),
]
CASES = [("llama", *case) for case in FULL] + [
    (family, *case) for family in FAMILIES if family != "llama" for case in PAIRWISE
]


def _case_id(case) -> str:
    family, padding, labels, devices, num_mb = case
    return f"{family}-{padding}-{'labels' if labels else 'nolabels'}-{devices}dev-{num_mb}mb"


def _model(family: str, num_mb: int, **overrides):
    if family in MOE_FAMILIES and num_mb > 1:
        overrides.setdefault("output_router_logits", False)  # the aux loss does not split (module docstring)
    return build_model(family, **overrides)


def _batch(family: str, padding: str) -> dict[str, torch.Tensor]:
    return make_batch("none" if family == "gemma2" and padding == "left" else padding)


def _expected_grads(ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF's gradients by name; a parameter HF's graph never reached (an expert no token picked) has zero."""
    return {
        name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in ref.named_parameters()
        if p.requires_grad
    }


def _engine_grads(engine) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in engine.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"no gradient for {name}"
            grads[name] = p.grad.clone()
    return grads


def _logits_weights(shape, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=dtype)


def check_against_hf(model, batch, labels: bool, devices: int, num_mb: int, float32_norms: bool = False):
    """Runs the engine on `model` and the plain HF forward/backward on a copy; asserts they agree. Returns nothing;
    closes the engine."""
    ref = copy.deepcopy(model)
    unlabeled = {k: v for k, v in batch.items() if k != "labels"}
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * devices, num_microbatches=num_mb))
    try:
        if labels:
            expected_loss = reference_loss(ref, batch)
            expected_loss.backward()
            expected = _expected_grads(ref)

            loss = engine.forward_backward(**batch)  # the engine API
            model.train()
            out = model(**batch)  # the patched HF call of a stock training loop, accumulating on top
            assert out.logits is None
            out.loss.backward()
            engine.synchronize()

            assert_close(loss, expected_loss.detach(), "loss of forward_backward")
            assert_close(out.loss.detach(), expected_loss.detach(), "loss of model(**batch)")
            twice = {name: 2 * grad for name, grad in expected.items()}
            assert_same_gradients(_engine_grads(engine), twice, float32_norms=float32_norms)
        else:
            ref_logits = ref(**unlabeled).logits
            weights = _logits_weights(ref_logits.shape, ref_logits.dtype)
            (ref_logits * weights).sum().backward()  # any function of the logits
            expected = _expected_grads(ref)

            model.train()
            logits = model(**unlabeled).logits
            assert logits.requires_grad
            assert_close(logits.detach(), ref_logits.detach(), "train-mode logits")
            (logits * weights).sum().backward()
            engine.synchronize()
            assert_same_gradients(_engine_grads(engine), expected, float32_norms=float32_norms)

        ref.eval()
        model.eval()
        with torch.no_grad():
            ref_out = ref(**batch)
            out = model(**batch)
            unlabeled_out = model(**unlabeled)
        assert_close(out.logits, ref_out.logits, "eval logits")
        assert_close(unlabeled_out.logits, ref_out.logits, "eval logits without labels")
        assert unlabeled_out.loss is None
        assert_close(out.loss, ref_out.loss, "eval loss vs HF's float32 loss", rtol=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_engine_equals_hf(case):
    family, padding, labels, devices, num_mb = case
    check_against_hf(
        _model(family, num_mb),
        _batch(family, padding),
        labels,
        devices,
        num_mb,
        float32_norms=family in FLOAT32_NORM_FAMILIES,
    )


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES & set(FAMILIES)))
@pytest.mark.parametrize("devices", [1, 2])
def test_router_aux_loss_of_one_micro_batch_equals_hf(family, devices):
    """With one micro-batch the fused loss includes HF's router aux loss exactly (gradients through the routers)."""
    model = build_model(family)
    assert model.config.output_router_logits
    batch = make_batch("left" if devices == 1 else "right")
    hf = copy.deepcopy(model)(**batch)
    assert hf.aux_loss is not None and hf.aux_loss > 0  # the aux loss is really part of the loss checked
    check_against_hf(model, batch, labels=True, devices=devices, num_mb=1)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES & set(FAMILIES)))
def test_eval_loss_includes_the_router_aux_loss_over_several_micro_batches(family):
    """Eval (forward-only) carries the router statistics of the whole batch, so its loss is HF's, aux included,
    whatever the micro-batch count; in eval mode with grad enabled, its backward gives HF's gradients (through the
    float32 logits HF's loss uses, hence the float32 tolerance)."""
    model = build_model(family)
    batch = make_batch("left")
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        expected_float64 = reference_loss(ref, batch)
    expected = ref(**batch)
    expected.loss.backward()
    assert expected.aux_loss > 0
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert_close(out.logits, expected.logits.detach(), "eval logits")
    assert_close(out.loss, expected.loss.detach(), "eval loss with router aux vs HF's", rtol=1e-6)
    assert_close(out.loss.double(), expected_float64, "eval loss vs HF's loss in float64", rtol=1e-6)

    model(**batch).loss.backward()  # eval mode, grad enabled: the forward pipeline, then the backward pipeline
    engine.synchronize()
    assert_same_gradients(_engine_grads(engine), _expected_grads(ref), rtol=1e-6)
    engine.close()


@pytest.mark.parametrize(("devices", "num_mb"), [(1, 1), (2, 2), (2, 3)])
def test_tied_embeddings_gradient_of_the_shared_weight(devices, num_mb):
    """Qwen3-style tied embeddings: one Parameter in the engine; its gradient (embedding + lm_head) is HF's, and an
    optimizer step keeps the two uses tied."""
    model = build_model("qwen3", tie_word_embeddings=True)
    ref = copy.deepcopy(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = make_batch("left")
    expected_loss = reference_loss(ref, batch)
    expected_loss.backward()
    shared_grad = ref.model.embed_tokens.weight.grad

    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * devices, num_microbatches=num_mb))
    names = [name for name, _ in engine.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.5))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, expected_loss.detach(), "loss")
    grads = _engine_grads(engine)
    assert_close(grads["model.embed_tokens.weight"], shared_grad, "grad of the shared weight")
    assert_same_gradients(grads, _expected_grads(ref))

    optimizer.step()
    optimizer.zero_grad()
    engine.synchronize()
    engine.close()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        stepped = ref.model.embed_tokens.weight - 0.5 * shared_grad
    assert_close(model.model.embed_tokens.weight.detach(), stepped, "shared weight after one SGD step")
