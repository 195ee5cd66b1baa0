"""`RoundPipeTrainer` with the optimizer state on the device (`--roundpipe_optimizer_placement device`; on CPU workers
the device is the CPU, the buckets take the device path) against `transformers.Trainer`: clipping on, a scheduler
(cosine decay), the same logged losses, gradient norms and learning rates, the same weights; and a checkpoint
written with every bucket on the device resumes with every bucket on the host as the uninterrupted run goes on."""

from __future__ import annotations

import os

import torch
from roundpipe_testing import assert_close_lists
from tiny_llama_model import seeded_tiny_llama

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

STEPS = 4


def _data():
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, _ = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train.select(range(2 * STEPS))


def _flags(output_dir: str, *extra: str) -> list[str]:
    return ["--output_dir", output_dir, "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine", "--max_grad_norm",
            "1.0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--use_cpu", "true", "--dataloader_pin_memory", "false", "--seed", "0", *extra]


def _roundpipe_flags(placement: str) -> list[str]:
    return ["--roundpipe_devices", "cpu,cpu", "--roundpipe_num_microbatches", "2",
            "--roundpipe_optimizer_placement", placement]


def _trainer(data, flags: list[str], roundpipe: bool):
    """A trainer whose arguments come through `HfArgumentParser`, as a script's command line gives them."""
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    tokenizer, train = data
    args_class = RoundPipeTrainingArguments if roundpipe else TrainingArguments
    (args,) = HfArgumentParser(args_class).parse_args_into_dataclasses(flags)
    trainer_class = RoundPipeTrainer if roundpipe else Trainer
    return trainer_class(model=seeded_tiny_llama(len(tokenizer)), args=args, train_dataset=train)


def _logged(trainer, key: str) -> list:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def _weights(trainer) -> dict[str, torch.Tensor]:
    if getattr(trainer, "roundpipe_engine", None) is not None:
        trainer.roundpipe_engine.synchronize()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _close(trainer) -> None:
    if trainer.roundpipe_engine is not None:
        trainer.roundpipe_engine.close()


def _assert_placed(trainer, placement: str) -> None:
    engine = trainer.roundpipe_engine
    trainable = sorted(b.index for b in engine.host_store.trainable_buckets)
    on_device = sorted(engine.optimizer_placement.device_buckets)
    assert on_device == (trainable if placement == "device" else [])
    assert sorted(engine.optimizer_placement.host_buckets) == (trainable if placement == "host" else [])


def _assert_same_weights(ours: dict, theirs: dict, **tolerance) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def test_device_placement_trains_as_the_plain_trainer(tmp_path):
    data = _data()
    reference = _trainer(data, _flags(str(tmp_path / "plain")), roundpipe=False)
    reference.train()
    ours = _trainer(data, _flags(str(tmp_path / "rp"), *_roundpipe_flags("device")), roundpipe=True)
    assert ours.args.roundpipe_optimizer_placement == "device"
    try:
        ours.train()
        _assert_placed(ours, "device")
        norms = _logged(reference, "grad_norm")
        assert any(norm > 1.0 for norm in norms)  # the clip applied
        rates = _logged(reference, "learning_rate")
        assert len(set(rates)) == STEPS  # the scheduler moved the rate every step
        assert_close_lists(_logged(ours, "learning_rate"), rates, "learning rates", 1e-12)
        assert_close_lists(_logged(ours, "loss"), _logged(reference, "loss"), "losses")
        assert_close_lists(_logged(ours, "grad_norm"), norms, "gradient norms", 3e-4)
        # float32: AdamW turns the rounding of near-zero gradients into differences of up to about 1.3e-5 here (a
        # one-step lag gives 7e-3)
        _assert_same_weights(_weights(ours), _weights(reference), rtol=1e-4, atol=5e-5)
    finally:
        _close(ours)


def test_a_device_checkpoint_resumes_on_the_host(tmp_path):
    """Checkpoint at step 2 (model, optimizer, scheduler, RNG) written with every bucket on the device, resumed in a
    new trainer with every bucket on the host: steps 3-4 log the uninterrupted run's losses and end with its
    weights."""
    data = _data()
    saving = ["--save_strategy", "steps", "--save_steps", "2"]
    full = _trainer(data, _flags(str(tmp_path / "full"), *saving, *_roundpipe_flags("device")), roundpipe=True)
    try:
        full.train()
        _assert_placed(full, "device")
        full_losses, full_weights = _logged(full, "loss"), _weights(full)
    finally:
        _close(full)
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt"} <= set(os.listdir(checkpoint))

    resumed = _trainer(data, _flags(str(tmp_path / "resumed"), *saving, *_roundpipe_flags("host")), roundpipe=True)
    try:
        resumed.train(resume_from_checkpoint=checkpoint)
        _assert_placed(resumed, "host")
        assert_close_lists(_logged(resumed, "loss")[2:], full_losses[2:], "steps 3-4 after resume", 1e-6)
        _assert_same_weights(_weights(resumed), full_weights, rtol=1e-6, atol=1e-7)
    finally:
        _close(resumed)
