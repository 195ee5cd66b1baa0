"""[Note: looking changes nothing]: with the lagged step, evaluating, synchronizing or reading the state dict shows
every step taken, gives the same answer twice, and leaves the training trajectory exactly as without looking."""

from __future__ import annotations

import copy

import torch

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import batch, run_layers, tied_model

STEPS = 5
LOOK_AFTER = 2


def _train(look: bool):
    model = tied_model()
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=True))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    losses, looks = [], []
    for step in range(STEPS):
        x, mask, y = batch(seed=step)
        losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy))
        optimizer.step()
        optimizer.zero_grad()
        if look and step == LOOK_AFTER:
            x_eval, mask_eval, _ = batch(seed=100)
            with torch.no_grad():
                first = engine(x_eval, mask_eval)  # an evaluation pass, no synchronize before it
                second = engine(x_eval, mask_eval)
            weights = copy.deepcopy(engine.state_dict())  # a checkpoint's look
            plain = copy.deepcopy(tied_model())
            plain.load_state_dict(weights)
            with torch.no_grad():
                expected = run_layers(plain, (x_eval, mask_eval))
            looks.append((first, second, expected, weights))
    engine.synchronize()
    final = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    engine.close()
    return [float(loss) for loss in losses], final, looks


def test_looking_changes_nothing_and_shows_every_step():
    losses, final, _ = _train(look=False)
    looked_losses, looked_final, looks = _train(look=True)
    assert looked_losses == losses  # bit for bit: the look changed no later step
    for name, tensor in final.items():
        assert torch.equal(looked_final[name], tensor), name
    first, second, expected, weights = looks[0]
    assert torch.equal(first, second)  # evaluate twice, same answer
    torch.testing.assert_close(first, expected, rtol=1e-12, atol=1e-12)  # the evaluation saw the saved weights
    # The weights shown are the step-3 weights (steps 0..2 all taken), not the ones the next pass computes with.
    reference, *_ = _train_steps_plain(LOOK_AFTER + 1)
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-12, atol=1e-14, msg=name)


def _train_steps_plain(steps: int):
    """The lagged step in plain PyTorch: iteration k computes its gradient on the weights after k-1 steps."""
    model = tied_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    previous = copy.deepcopy(model.state_dict())  # the weights the next gradient is computed on
    for step in range(steps):
        x, mask, y = batch(seed=step)
        stale = copy.deepcopy(tied_model())
        stale.load_state_dict(previous)
        previous = copy.deepcopy(model.state_dict())
        halves = [torch.tensor_split(t, 2) for t in (x, mask, y)]
        for xs, ms, ys in zip(*halves):
            part = torch.nn.functional.cross_entropy(run_layers(stale, (xs, ms)), ys) * (xs.shape[0] / x.shape[0])
            part.backward()
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad = q.grad
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), None


def test_lagged_weights_from_a_checkpoint_are_used_by_the_lagged_step_only():
    """A resume restores the weights the next pass computes with under the lagged step; an engine resumed with the
    exact step computes with the newest weights instead, so it ignores them."""
    for async_optimizer in (True, False):
        saver = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, async_optimizer=True))
        optimizer = saver.wrap_optimizer(torch.optim.AdamW(saver.parameters(), lr=1e-2))
        x, mask, y = batch()
        saver.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        optimizer.step()
        lagged = saver.lagged_weights()
        assert lagged  # the step is held: the next pass would compute with the weights before it
        state = copy.deepcopy(saver.state_dict())
        saver.close()

        engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2,
                                                         async_optimizer=async_optimizer))
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
        engine.load_state_dict(state)
        engine.load_lagged_weights(lagged)
        stashed = [b for b in engine._store.buckets if b.stash is not None]
        assert bool(stashed) == async_optimizer
        engine.close()
