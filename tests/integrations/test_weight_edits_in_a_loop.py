"""[Note: weight edits followed] through the Accelerate loop as a user writes it: `model.load_state_dict(...)` on the
prepared model after some steps is what training continues from, as in plain Accelerate (it used to be overwritten
by the optimizer copies at the next upload: loss 3.94 where the loaded weights give 4.17)."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin


def test_load_state_dict_on_the_prepared_model_is_what_training_continues_from():
    """The Accelerate loop: `model.load_state_dict(...)` after some steps (e.g. going back to the best weights)."""
    best = {k: v.double() for k, v in tiny_llama(seed=5).state_dict().items()}

    def train(accelerator, model) -> list[float]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        model.train()
        losses = []
        for seed in range(4):
            loss = model(**lm_batch(seed=seed)).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if seed == 1:
                model.load_state_dict(best)
        return losses

    plain = train(Accelerator(cpu=True), tiny_llama().double())
    ours = train(RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**CPU_WORKERS)), tiny_llama().double())
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(plain), rtol=1e-9, atol=0)
