"""[Note: the model's own loss function] under data parallelism (two gloo processes, CPU workers, float64): the
user's loss function is computed from each rank's logits as under DDP, and `forward_backward` refuses it by name."""

from __future__ import annotations

import model_loss_scenarios
from ranks import run_ranks


def test_own_loss_function_on_two_ranks():
    for refusal in run_ranks(model_loss_scenarios.own_loss_on_each_rank, 2, timeout_s=180):
        assert refusal is not None, "forward_backward ran the model's own loss under data parallelism"
        assert "loss function is tripled" in refusal and "several processes" in refusal, refusal
        assert "accelerator.backward(loss)" in refusal, refusal
