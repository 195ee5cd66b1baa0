"""A non-finite global gradient norm under clipping behaves as `torch.nn.utils.clip_grad_norm_` + AdamW on the plain
model, exact and lagged ([Note: non-finite clip]): an infinite norm (gradients around 1e25, whose squares overflow
float32) clips to a zero gradient and the step goes on; a NaN norm multiplies every gradient by NaN."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

MAX_NORM = 1.0


MARK = 99.0  # an input whose first value is this gives the first layer's weight a NaN gradient


class MarkedLinear(nn.Linear):
    """A linear layer whose weight gradient is NaN (0 * inf, through the square root of 0) on a marked input; its
    output and the other layers' gradients stay finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if bool(x[0, 0] == MARK):
            out = out + 0 * torch.sqrt(self.weight - self.weight.detach()).sum()
        return out


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MarkedLinear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(kind: str):
    """Step 0 gives a non-finite global norm (`kind`); the steps after are ordinary."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(3)]
    if kind == "nan":
        batches[0][0][0, 0] = MARK
    return batches


def _loss_fns(kind: str):
    def mse(out, y):
        return nn.functional.mse_loss(out, y)

    def huge(out, y):  # finite gradients of about 1e25 and more: their squares overflow float32
        return nn.functional.mse_loss(out, y) * 1e25

    return [huge if kind == "inf" else mse, mse, mse]


def _torch_reference(kind: str, async_optimizer: bool):
    """Plain torch on the same model; the lagged step computes iteration k with the weights after steps 0..k-2."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    stale = copy.deepcopy(model)
    norms, weights = [], []
    for (x, y), loss_fn in zip(_batches(kind), _loss_fns(kind)):
        runner = stale if async_optimizer else model
        runner.zero_grad()
        loss_fn(runner(x), y).backward()
        if async_optimizer:
            for p, q in zip(model.parameters(), runner.parameters()):
                p.grad = q.grad.clone()
            stale.load_state_dict(model.state_dict())  # the next pass reads this step's input weights
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return norms, weights


def _roundpipe(kind: str, async_optimizer: bool):
    engine = RoundPipe(_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=1,
                                                 async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2, weight_decay=0.1))
    norms, weights = [], []
    try:
        for (x, y), loss_fn in zip(_batches(kind), _loss_fns(kind)):
            engine.forward_backward(x, labels=y, loss_fn=loss_fn)
            norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            engine.synchronize()  # shows the newest weights without changing what the next pass reads
            weights.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
        return norms, weights
    finally:
        engine.close()


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["exact", "lagged"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_a_non_finite_norm_clips_as_torch_does(kind, async_optimizer):
    torch_norms, torch_weights = _torch_reference(kind, async_optimizer)
    norms, weights = _roundpipe(kind, async_optimizer)
    assert str(torch_norms[0]) == kind  # the case under test
    torch.testing.assert_close(norms, torch_norms, equal_nan=True)
    for step, (theirs, ours) in enumerate(zip(torch_weights, weights)):
        for name, tensor in theirs.items():
            if kind == "nan":
                assert tensor.isnan().all(), name  # torch multiplies every gradient by NaN
            torch.testing.assert_close(ours[name], tensor, equal_nan=True, msg=f"step {step}: {name}")


def test_squares_past_the_dtypes_largest_value_give_torchs_infinite_norm():
    """Two float32 gradients whose norms are finite but whose summed squares overflow float32: torch's norm of the
    per-tensor norms is infinite, and so is the sum of the buckets' squares."""
    from accelerate_roundpipe.runtime.common.sync import FailureFlag
    from accelerate_roundpipe.runtime.stepping.step_norm import StepNorm

    grads = [torch.full((1,), 1.41e19), torch.full((1,), 1.41e19)]
    params = [nn.Parameter(torch.zeros(1)) for _ in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    step_norm = StepNorm(len(grads), MAX_NORM, dtype=torch.float32)
    for g in grads:
        step_norm.add(float(torch.linalg.vector_norm(g)) ** 2)
    assert float(expected) == step_norm.norm.get(FailureFlag()) == float("inf")
    assert step_norm.clip_coefficient(FailureFlag()) == 0.0
