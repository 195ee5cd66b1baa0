"""Way 2: `RoundPipeTrainer` used directly, against `transformers.Trainer` on the same model and data."""

from __future__ import annotations

import os

import pytest
import torch
from roundpipe_testing import assert_close_lists, staleness_one

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

STEPS = 20


@pytest.fixture(scope="module")
def data():
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train, held_out


def make_model(vocab_size: int):
    from transformers import LlamaForCausalLM, set_seed

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    set_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size))


def common_args(output_dir: str, **overrides) -> dict:
    values = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                  use_cpu=True, dataloader_pin_memory=False, max_grad_norm=1.0)
    values.update(overrides)
    return values


def plain_trainer(data, output_dir, optimizer_cls=None, **overrides):
    from transformers import Trainer, TrainingArguments

    tokenizer, train, held_out = data
    args = TrainingArguments(**common_args(output_dir, **overrides))
    extra = {}
    if optimizer_cls is not None:
        _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        extra["optimizer_cls_and_kwargs"] = (optimizer_cls, kwargs)
    return Trainer(model=make_model(len(tokenizer)), args=args, train_dataset=train, eval_dataset=held_out, **extra)


def roundpipe_trainer(data, output_dir, async_optimizer=False, **overrides):
    tokenizer, train, held_out = data
    args = RoundPipeTrainingArguments(**common_args(output_dir, **overrides), roundpipe_devices="cpu,cpu",
                                      roundpipe_num_microbatches=2, roundpipe_async_optimizer=async_optimizer)
    return RoundPipeTrainer(model=make_model(len(tokenizer)), args=args, train_dataset=train, eval_dataset=held_out)


def logged(trainer, key="loss") -> list:
    return [entry.get(key) for entry in trainer.state.log_history if "loss" in entry]


def close(trainer) -> None:
    if trainer.roundpipe_engine is not None:
        trainer.roundpipe_engine.close()


@pytest.mark.parametrize("accumulation", [1, 4])
def test_sync_equals_trainer(data, tmp_path, accumulation):
    """Sync optimizer, max_grad_norm on: every logged loss and (exact, this-step) gradient norm match Trainer's.
    One process drives both workers: no DataParallel, the model stays on the CPU, the batch is not multiplied."""
    reference = plain_trainer(data, str(tmp_path / "plain"), gradient_accumulation_steps=accumulation)
    reference.train()
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), gradient_accumulation_steps=accumulation)
    ours.train()
    assert_close_lists(logged(ours), logged(reference), "losses")
    # float32: the fused loss head sums each chunk's gradients in another order than autograd does, and 20 clipped
    # steps carry that rounding forward (relative differences stay below 5e-5; the head is exact in float64).
    assert_close_lists(logged(ours, "grad_norm"), logged(reference, "grad_norm"), "gradient norms", 3e-4)
    assert ours.model_wrapped is ours.model and not isinstance(ours.model, torch.nn.DataParallel)
    assert ours.args.n_gpu <= 1 and ours._train_batch_size == 4
    assert all(p.device.type == "cpu" for p in ours.model.parameters())
    assert type(ours.optimizer.optimizer.inner) is type(reference.optimizer.optimizer)  # the user's class, fused
    assert ours.optimizer.optimizer.inner.param_groups[0].get("fused") is True
    close(ours)


def test_async_follows_the_staleness_one_reference(data, tmp_path):
    """async_optimizer=True: the Trainer's losses are those of a Trainer whose AdamW keeps its master weights one
    step ahead of the model's (staleness 1)."""
    from transformers import Trainer

    optimizer_cls, _ = Trainer.get_optimizer_cls_and_kwargs(
        RoundPipeTrainingArguments(**common_args(str(tmp_path / "x"))))
    reference = plain_trainer(data, str(tmp_path / "plain"), optimizer_cls=staleness_one(optimizer_cls))
    reference.train()
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), async_optimizer=True)
    ours.train()
    assert_close_lists(logged(ours), logged(reference), "async vs staleness-1 reference")
    close(ours)


def test_grad_norm_without_clipping_is_logged_one_step_late(data, tmp_path):
    """max_grad_norm=0: no synchronizing clip; the norm logged at step k is step k-1's (see docs/ways-in.md)."""
    reference = plain_trainer(data, str(tmp_path / "plain"), max_grad_norm=0.0, max_steps=6)
    reference.train()
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), max_grad_norm=0.0, max_steps=6)
    ours.train()
    norms = logged(ours, "grad_norm")
    reference_norms = logged(reference, "grad_norm")
    assert_close_lists(logged(ours), logged(reference), "losses")
    if all(norm is None for norm in reference_norms):  # transformers 4.x logs no norm when it does not clip
        close(ours)
        return
    assert norms[0] is None
    assert_close_lists(norms[1:], reference_norms[:-1], "late gradient norms", 1e-4)
    close(ours)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_resume_repeats_the_uninterrupted_run(data, tmp_path, async_optimizer):
    """Checkpoint at step 10 (save_pretrained + optimizer + scheduler + RNG, lagged step flushed), resume from it in
    a new trainer: steps 11-20 log the uninterrupted run's losses."""
    out = str(tmp_path / "run")
    full = roundpipe_trainer(data, out, async_optimizer, save_strategy="steps", save_steps=10)
    full.train()
    checkpoint = os.path.join(out, "checkpoint-10")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(os.listdir(checkpoint))
    close(full)
    resumed = roundpipe_trainer(data, str(tmp_path / "resumed"), async_optimizer, save_strategy="steps", save_steps=10)
    resumed.train(resume_from_checkpoint=checkpoint)
    # The resumed history starts with the checkpoint's ten entries.
    assert_close_lists(logged(resumed)[10:], logged(full)[10:], "steps 11-20 after resume")
    close(resumed)


def test_evaluate_and_predict_equal_trainer(data, tmp_path):
    """Evaluation and prediction run the forward-only pipeline (no_grad, eval mode): same loss and logits."""
    reference = plain_trainer(data, str(tmp_path / "plain"), max_steps=3)
    reference.train()
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), max_steps=3)
    ours.train()
    assert abs(ours.evaluate()["eval_loss"] - reference.evaluate()["eval_loss"]) < 1e-5
    held_out = data[2]
    ours_out, reference_out = ours.predict(held_out), reference.predict(held_out)
    torch.testing.assert_close(torch.as_tensor(ours_out.predictions), torch.as_tensor(reference_out.predictions),
                               atol=1e-4, rtol=0)
    assert abs(ours_out.metrics["test_loss"] - reference_out.metrics["test_loss"]) < 1e-5
    close(ours)


def test_evaluate_before_training(data, tmp_path):
    """evaluate() first prepares the model for the forward pipeline; train() afterwards reuses that engine."""
    reference = plain_trainer(data, str(tmp_path / "plain"), max_steps=4)
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), max_steps=4)
    assert abs(ours.evaluate()["eval_loss"] - reference.evaluate()["eval_loss"]) < 1e-5
    engine = ours.roundpipe_engine
    reference.train()
    ours.train()
    assert ours.roundpipe_engine is engine
    assert_close_lists(logged(ours), logged(reference), "losses after an evaluation")
    close(ours)


def test_live_metrics_reach_the_logs(data, tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_PEAK_TFLOPS", "1.0")
    monkeypatch.setenv("ROUNDPIPE_TRACE", str(tmp_path / "trace.json"))
    trainer = roundpipe_trainer(data, str(tmp_path), max_steps=6, logging_steps=2)
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    rated = [entry for entry in entries if "roundpipe/tokens_per_s" in entry]
    assert len(rated) == len(entries)  # every log carries the rates since the previous one (the first: since step 1)
    assert all(entry["roundpipe/tokens_per_s"] > 0 and entry["roundpipe/host_rss_gib"] > 0 for entry in rated)
    assert all(0 < entry["roundpipe/mfu"] < 1 and 0 <= entry["roundpipe/bubble"] < 1 for entry in rated)
    engine = trainer.roundpipe_engine
    assert engine.counters.tokens == 6 * 4 * 32 and engine.counters.passes == 6  # steps x rows x block size
    close(trainer)


class _WeightReader:
    """A user's callback (an EMA, a weight-norm log): the weights of the `model=` it is given, after each step."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Reader(TrainerCallback):
            def __init__(self):
                self.seen = []

            def on_step_end(self, args, state, control, model=None, **kwargs):
                self.seen.append({n: p.detach().clone() for n, p in model.named_parameters()})

        return Reader()


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_callback_sees_the_weights_after_each_step(data, tmp_path, async_optimizer):
    """[Note: callbacks see the newest weights]: a callback's `on_step_end` reading `model.named_parameters()` sees
    the weights after the step just taken, as under the plain Trainer (exact), or as a synchronized reader shows them
    (lagged), and reading changes no step. Before, it saw the initial weights at every step (2.5e-2 off the plain
    run's after the third)."""
    reference_reader, reader = _WeightReader(), _WeightReader()
    if async_optimizer:  # the lagged trajectory: what `model.state_dict()` after `synchronize()` shows
        reference = roundpipe_trainer(data, str(tmp_path / "ref"), async_optimizer=True, max_steps=3,
                                      learning_rate=1e-2)

        class Synchronized(type(reference_reader)):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                reference.roundpipe_engine.synchronize()
                super().on_step_end(args, state, control, model=model, **kwargs)

        reference_reader = Synchronized()
    else:
        reference = plain_trainer(data, str(tmp_path / "plain"), max_steps=3, learning_rate=1e-2)
    reference.add_callback(reference_reader)
    reference.train()
    ours = roundpipe_trainer(data, str(tmp_path / "rp"), async_optimizer=async_optimizer, max_steps=3,
                             learning_rate=1e-2)
    ours.add_callback(reader)
    ours.train()
    assert len(reader.seen) == len(reference_reader.seen) == 3
    for step, (got, want) in enumerate(zip(reader.seen, reference_reader.seen), start=1):
        worst = max(float((got[name] - want[name]).abs().max()) for name in want)
        # float32: AdamW's first steps move each weight by about lr (1e-2); the runs' rounding leaves 4e-5
        assert worst < 1e-3, f"on_step_end after step {step}: the callback's weights are {worst:.3g} off"
    assert_close_lists(logged(ours), logged(reference), "losses with the reading callback")
    close(ours)
    ours.evaluate(eval_dataset=data[2].select(range(2)))  # the model's own forward again; no look at a closed engine
    if async_optimizer:
        close(reference)


def test_only_callbacks_that_name_the_model_cost_a_look():
    """A look waits for the step in flight: a timer or a logger of `logs` (the benchmarks' own callbacks) never
    names the model and costs none; a handler naming it as a parameter or through `kwargs["model"]` (TRL's
    SyncRefModelCallback) gets one; transformers' own callbacks none."""
    from transformers import EarlyStoppingCallback, TrainerCallback

    from accelerate_roundpipe.integrations.trainer import _reads_the_model

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            self.last = state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs = logs

    class Named(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            pass

    class FromKwargs(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            self.norm = sum(p.norm() for p in kwargs["model"].parameters())

    assert not any(_reads_the_model(Timer(), event) for event in ("on_step_end", "on_log", "on_evaluate"))
    assert _reads_the_model(Named(), "on_step_end") and _reads_the_model(FromKwargs(), "on_log")
    assert not _reads_the_model(EarlyStoppingCallback(), "on_evaluate")
