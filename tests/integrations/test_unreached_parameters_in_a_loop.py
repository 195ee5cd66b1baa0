"""[Note: parameters without a gradient] through the Accelerate loop as a user writes it: a trainable module of a
decoder layer that the forward never calls (an adapter left in, a head not used for this loss) is not stepped,
as plain Accelerate leaves it; the rest trains the same."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from integration_unit_helpers import CPU_WORKERS, float64_causal_lm_loss, lm_batch, named_groups, tiny_llama

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin


def _model_with_an_unused_module():
    model = tiny_llama().double()
    model.model.layers[0].self_attn.unused_proj = torch.nn.Linear(32, 32, dtype=torch.float64)  # never called
    model.loss_function = float64_causal_lm_loss  # HF's own casts the logits to float32
    return model


def _train(accelerator, model) -> list[float]:
    optimizer = torch.optim.AdamW(named_groups(model, weight_decay=0.1), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses = []
    for seed in range(3):
        loss = model(**lm_batch(seed=seed)).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_an_unused_module_is_not_stepped_as_plain_accelerate_leaves_it():
    plain_model, model = _model_with_an_unused_module(), _model_with_an_unused_module()
    before = plain_model.model.layers[0].self_attn.unused_proj.weight.detach().clone()
    plain_losses = _train(Accelerator(cpu=True), plain_model)
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**CPU_WORKERS))
    losses = _train(accelerator, model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-10, atol=0)
    ours = accelerator.get_state_dict(model)
    for name, theirs in plain_model.state_dict().items():
        # Adam divides by the root of tiny second moments, so float64 rounding of the micro-batch sums shows at 1e-7
        torch.testing.assert_close(ours[name], theirs, rtol=1e-5, atol=1e-6, msg=name)
    # plain torch skipped it: weight decay alone would have moved it by lr * 0.1 a step
    assert torch.equal(ours["model.layers.0.self_attn.unused_proj.weight"], before)
