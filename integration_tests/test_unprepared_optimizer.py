"""Optimizers RoundPipe does not step ([Note: optimizers the engine does not step]), in the Accelerate loop as a user
writes it: each either trains as under the plain `Accelerator` (same losses and weights) or is refused at its first
`step()` with the call that hands it over. Before, an optimizer over `model.parameters()` that was never prepared
stepped nothing (the same loss every step, nothing said), and two optimizers given to `prepare` hung the next pass.
"""

from __future__ import annotations

import accelerate
import pytest
import torch
from roundpipe_testing import assert_close_lists, reset_accelerate_state
from tiny_llama_model import seeded_tiny_llama

from accelerate_roundpipe import RoundPipe, RoundPipeAccelerator, RoundPipeConfig, RoundPipePlugin

VOCAB = 96
STEPS = 4
PREPARE = r"accelerator\.prepare\(model, optimizer\)"
# Float32 AdamW at lr 1e-2 turns rounding into up to 1.4e-5 in a weight after 4 steps; a step moves it by ~1e-2.
WEIGHTS_ATOL = 1e-4
CPU_WORKERS = dict(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=False)


def batches() -> list[dict[str, torch.Tensor]]:
    """One batch of random tokens, `STEPS` times: the loss falls as the model learns it."""
    ids = torch.randint(4, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()} for _ in range(STEPS)]


def head_only(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.startswith(("lm_head", "model.norm"))]


def all_parameters(model) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def loop(accelerator, model, optimizer, steps: list[dict]) -> list[float]:
    """The stock loop: forward, `accelerator.backward`, step, zero_grad."""
    losses = []
    for batch in steps:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def plain_run(parameters=all_parameters) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same loop under accelerate's own `Accelerator`, the optimizer prepared with the model."""
    reset_accelerate_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = seeded_tiny_llama(VOCAB)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(parameters(model), lr=1e-2))
    model.train()
    losses = loop(accelerator, model, optimizer, batches())
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    reset_accelerate_state()
    return losses, weights


@pytest.fixture
def roundpipe():
    """`make(**settings)` -> (a RoundPipeAccelerator on two CPU workers, a fresh tiny Llama); engines closed after."""
    made = []

    def make(**settings):
        reset_accelerate_state()
        accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**{**CPU_WORKERS, **settings}))
        model = seeded_tiny_llama(VOCAB)
        made.append((accelerator, model))
        return accelerator, model

    yield make
    for accelerator, model in made:
        engine = accelerator.roundpipe_engine(model)
        if engine is not None:
            engine.close()
    reset_accelerate_state()


def named(name: str):
    return lambda message: f"{name}: {message}"


def assert_trains_like_plain(accelerator, model, losses, reference) -> None:
    plain_losses, plain_weights = reference
    assert_close_lists(losses, plain_losses, "losses, RoundPipe vs plain Accelerator")
    assert plain_losses[-1] < plain_losses[0] - 0.3  # the plain run does train
    state = accelerator.unwrap_model(model).state_dict()
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(state[name], tensor, atol=WEIGHTS_ATOL, rtol=0, msg=named(name))


def first_step_refused(accelerator, model, optimizer, match: str) -> float:
    """One iteration of the loop whose `optimizer.step()` must raise `match`; returns its loss."""
    model.train()
    loss = model(**batches()[0]).loss
    accelerator.backward(loss)
    with pytest.raises(RuntimeError, match=match):
        optimizer.step()
    return loss.item()


@pytest.mark.parametrize("built", ["before prepare", "after prepare"])
def test_an_optimizer_over_model_parameters_never_prepared_is_refused_at_its_first_step(roundpipe, built):
    accelerator, model = roundpipe()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if built == "before prepare" else None
    model = accelerator.prepare(model)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first_step_refused(accelerator, model, optimizer, f"would change nothing.*{PREPARE}")
    state = accelerator.unwrap_model(model).state_dict()
    assert all(torch.equal(state[k], v) for k, v in initial.items())  # refused before anything was stepped


def test_refused_then_prepared_in_a_later_call_it_trains_like_plain_accelerate(roundpipe):
    """The refusal leaves the iteration whole: the user prepares the optimizer and steps it, and the run is the
    plain run (plain accelerate allows the optimizer in a later `prepare` call)."""
    reference = plain_run()
    accelerator, model = roundpipe()
    model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [first_step_refused(accelerator, model, optimizer, PREPARE)]
    optimizer = accelerator.prepare(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    losses += loop(accelerator, model, optimizer, batches()[1:])
    assert_trains_like_plain(accelerator, model, losses, reference)


@pytest.mark.parametrize("parameters", [all_parameters, head_only], ids=["all parameters", "a subset"])
def test_an_optimizer_prepared_in_a_second_prepare_call_trains_like_plain_accelerate(roundpipe, parameters):
    reference = plain_run(parameters)
    accelerator, model = roundpipe()
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(parameters(model), lr=1e-2))
    model.train()
    assert_trains_like_plain(accelerator, model, loop(accelerator, model, optimizer, batches()), reference)


def test_a_subset_of_the_parameters_never_prepared_is_refused(roundpipe):
    accelerator, model = roundpipe()
    optimizer = torch.optim.AdamW(head_only(model), lr=1e-2)
    model = accelerator.prepare(model)
    first_step_refused(accelerator, model, optimizer, "holds 2 trainable parameter")


def test_an_optimizer_over_the_engines_optimizer_copies_is_refused_at_its_first_step(roundpipe):
    """The host copies that RoundPipe trains, stepped by an optimizer it was not given: before, the step changed
    them behind the engine's back (found only at the next pass)."""
    accelerator, model = roundpipe()
    model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(accelerator.roundpipe_engine(model).parameters(), lr=1e-2)
    first_step_refused(accelerator, model, optimizer, f"optimizer copies.*races.*{PREPARE}")


def test_stepping_the_users_optimizer_object_instead_of_the_prepared_one_is_refused(roundpipe):
    """`accelerator.prepare(model, optimizer)` without keeping the optimizer it returns: plain accelerate steps the
    same object either way; RoundPipe steps the returned one on its thread (before, the original stepped nothing)."""
    accelerator, model = roundpipe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, _ = accelerator.prepare(model, optimizer)
    first_step_refused(accelerator, model, optimizer, "RoundPipe took over.*Step the returned optimizer")


@pytest.mark.parametrize("change", ["add_param_group", "load_state_dict"])
def test_groups_changed_on_the_users_object_after_prepare_are_refused_at_the_next_step(roundpipe, change):
    """Before: a group added to the user's object after `prepare` never trained (the head kept its weights), and
    a state dict loaded into it replaced the groups an LR scheduler on it writes, the engine reading the old."""
    accelerator, model = roundpipe()
    head = head_only(model)
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    user_optimizer = torch.optim.AdamW(body, lr=1e-2)
    model, optimizer = accelerator.prepare(model, user_optimizer)
    if change == "add_param_group":
        user_optimizer.add_param_group({"params": head})
    else:
        user_optimizer.load_state_dict(user_optimizer.state_dict())
    first_step_refused(accelerator, model, optimizer, r"parameter groups changed after RoundPipe took it over")
    # Through the prepared optimizer a group is refused at once, naming where to add it.
    with pytest.raises(NotImplementedError, match=r"before handing it to RoundPipe.*accelerator\.prepare"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


def test_a_gradient_that_reached_the_models_parameters_outside_the_engine_is_refused_at_the_step(roundpipe):
    """A penalty on the weights computed outside the model's forward back-propagates into the parameters the model
    shows, which the engine never steps: before, it was dropped without a word (plain accelerate steps it)."""
    accelerator, model = roundpipe()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.train()
    loss = model(**batches()[0]).loss + 1e-2 * model.lm_head.weight.pow(2).sum()
    accelerator.backward(loss)
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) .*\(first: `lm_head.weight`\) got a gradient outside"):
        optimizer.step()


def test_a_second_optimizer_for_the_same_model_is_refused_at_its_first_step_instead_of_hanging(roundpipe):
    """Two optimizers given to `prepare` (body and head): the second replaces the first, whose steps used to queue
    on a stopped thread, and the next pass waited for them until the wait timeout."""
    accelerator, model = roundpipe(wait_timeout_s=20)
    head = head_only(model)
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    model, first, second = accelerator.prepare(model, torch.optim.AdamW(body, lr=1e-2),
                                               torch.optim.AdamW(head, lr=1e-2))
    first_step_refused(accelerator, model, first, r"a later optimizer was handed to the same RoundPipe model.*param "
                                                  r"groups")
    with pytest.raises(RuntimeError, match="no longer steps"):
        first.zero_grad()
    second.step()  # the optimizer in charge still steps, and the next pass runs
    second.zero_grad()
    assert torch.isfinite(model(**batches()[1]).loss)


def test_the_engine_api_with_an_optimizer_never_wrapped_is_refused_naming_wrap_optimizer():
    """`RoundPipe(...)` used with a plain torch optimizer: over `engine.parameters()` (its optimizer copies) or over
    the wrapped module's parameters (its compute copies), never passed to `wrap_optimizer`."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    engine = RoundPipe(layers, RoundPipeConfig(**CPU_WORKERS, summary=False))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    try:
        for params in (engine.parameters(), layers.parameters()):
            optimizer = torch.optim.SGD(params, lr=0.1)
            engine.forward_backward(x, labels=y, loss_fn=torch.nn.functional.cross_entropy)
            with pytest.raises(RuntimeError, match=r"engine\.wrap_optimizer\(optimizer\)"):
                optimizer.step()
            engine.zero_grad()
        wrapped = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        engine.forward_backward(x, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        wrapped.step()  # the engine's own steppers are let through
        wrapped.zero_grad()
        engine.synchronize()
    finally:
        engine.close()


def test_the_trainer_given_an_optimizer_built_before_it_trains_like_the_plain_trainer(tmp_path):
    """`optimizers=(optimizer, scheduler)` built over the model before the Trainer wrapped it: re-pointed at
    `prepare`, the same losses and weights as `transformers.Trainer` with the same pair."""
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    rows = [dict(b, input_ids=b["input_ids"][i], attention_mask=b["attention_mask"][i], labels=b["labels"][i])
            for b in batches() for i in range(4)]
    common = dict(max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", report_to=[],
                  disable_tqdm=True, seed=0, use_cpu=True, dataloader_pin_memory=False)
    results = []
    for trainer_class in (Trainer, RoundPipeTrainer):
        reset_accelerate_state()  # before the arguments, which set accelerate's state up
        if trainer_class is Trainer:
            args = TrainingArguments(str(tmp_path / "plain"), **common)
        else:
            args = RoundPipeTrainingArguments(str(tmp_path / "rp"), **common, roundpipe_devices="cpu,cpu",
                                              roundpipe_num_microbatches=2, roundpipe_async_optimizer=False)
        model = seeded_tiny_llama(VOCAB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * STEPS))
        trainer = trainer_class(model=model, args=args, train_dataset=rows, optimizers=(optimizer, scheduler))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        weights = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict()
                   .items()}
        if getattr(trainer, "roundpipe_engine", None) is not None:
            trainer.roundpipe_engine.close()
        results.append((losses, weights))
    reset_accelerate_state()
    (plain_losses, plain_weights), (losses, weights) = results
    assert_close_lists(losses, plain_losses, "Trainer losses, RoundPipe vs plain")
    assert plain_losses[-1] < plain_losses[0]
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(weights[name], tensor, atol=WEIGHTS_ATOL, rtol=0, msg=named(name))
