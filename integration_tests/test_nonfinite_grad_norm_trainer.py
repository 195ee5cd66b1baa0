"""`RoundPipeTrainer` against `transformers.Trainer` when the gradient norm is not finite, clipping on
([Note: non-finite clip]): the same logged losses (the Trainer's own `logging_nan_inf_filter` included) and gradient
norms, and the same weights after training."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_llama_model import seeded_tiny_llama

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

STEPS = 4
NAN_TOKEN = 5  # a token id the shipped text never produces
NAN_ROW = 3  # the training row that carries it: the plain Trainer's sampler (seed 0) draws it at step 2


@pytest.fixture(scope="module")
def data():
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train.select(range(2 * STEPS)), held_out.select(range(4))


def _model(vocab_size: int, kind: str):
    """`inf`: the final norm's weight scaled by 1e25, so the gradients (about 1e25) square past float32's largest
    value while the loss stays finite; `nan`: token NAN_TOKEN embeds as NaN, so the step that meets it has a NaN
    loss and NaN gradients."""
    model = seeded_tiny_llama(vocab_size)
    with torch.no_grad():
        if kind == "inf":
            model.model.norm.weight.mul_(1e25)
        else:
            model.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    return model


def _train_rows(train, kind: str):
    if kind == "inf":
        return train

    def mark(row, index):
        if index == NAN_ROW:
            row["input_ids"] = [NAN_TOKEN, *row["input_ids"][1:]]
        return row

    return train.map(mark, with_indices=True)


def _run(data, output_dir: str, kind: str, roundpipe: bool, async_optimizer: bool = False):
    from transformers import Trainer, TrainingArguments

    tokenizer, train, held_out = data
    values = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=3e-3,
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                  dataloader_pin_memory=False, max_grad_norm=1.0, logging_nan_inf_filter=True)
    model = _model(len(tokenizer), kind)
    if roundpipe:
        args = RoundPipeTrainingArguments(**values, roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=2,
                                          roundpipe_async_optimizer=async_optimizer)
        trainer = RoundPipeTrainer(model=model, args=args, train_dataset=_train_rows(train, kind))
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**values), train_dataset=_train_rows(train, kind))
    trainer.train()
    if roundpipe:
        trainer.roundpipe_engine.synchronize()
    history = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if roundpipe:
        trainer.roundpipe_engine.close()
    return history, weights


def _same(ours: float, theirs: float, rel: float = 1e-6) -> bool:
    if math.isnan(theirs) or math.isinf(theirs):
        return str(ours) == str(theirs)
    return ours == pytest.approx(theirs, rel=rel, abs=1e-6)


@pytest.mark.parametrize("kind,async_optimizer", [("inf", False), ("inf", True), ("nan", False)],
                         ids=["inf-exact", "inf-lagged", "nan-exact"])
def test_a_non_finite_norm_trains_as_the_plain_trainer(data, tmp_path, kind, async_optimizer):
    reference, reference_weights = _run(data, str(tmp_path / "plain"), kind, roundpipe=False)
    history, weights = _run(data, str(tmp_path / "rp"), kind, roundpipe=True, async_optimizer=async_optimizer)
    norms = [norm for _, norm in reference]
    if kind == "inf":  # every step: the clip zeroes the gradients and the weights never move
        assert all(math.isinf(norm) for norm in norms)
    else:  # a finite step, then the NaN one; the filter logs NaN losses as the average of the earlier ones
        assert math.isfinite(norms[0]) and all(math.isnan(norm) for norm in norms[1:])
        assert all(math.isfinite(loss) for loss, _ in reference)
    assert len(history) == len(reference)
    for step, ((loss, norm), (their_loss, their_norm)) in enumerate(zip(history, reference), start=1):
        assert _same(loss, their_loss) and _same(norm, their_norm, rel=1e-4), (step, history, reference)
    for name, tensor in reference_weights.items():
        if kind == "nan":
            assert tensor.isnan().all(), name  # torch's clip multiplies every gradient by the NaN coefficient
        torch.testing.assert_close(weights[name], tensor, equal_nan=True, msg=name)
