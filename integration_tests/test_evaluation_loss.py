"""[Note: evaluation loss]: `evaluate()` without `compute_metrics` computes the loss in the pipeline's head, never the
logits; the loss equals the plain Trainer's (float64) and the logits path is taken wherever more than the loss is
wanted."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

from accelerate_roundpipe import RoundPipeConfig, RoundPipeTrainer, RoundPipeTrainingArguments, wrap_model
from accelerate_roundpipe.models.head import CausalLMHead
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config


@pytest.fixture(scope="module")
def data():
    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train, held_out.select(range(10))  # 10 rows: the last batch of 4 is a short one


def _model(vocab_size: int) -> LlamaForCausalLM:
    set_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size)).double()


def _args(output_dir: str) -> dict:
    return dict(output_dir=output_dir, per_device_eval_batch_size=4, report_to=[], disable_tqdm=True, use_cpu=True,
                dataloader_pin_memory=False, seed=0)


def _no_logits(*args, **kwargs):
    raise AssertionError("the head made logits although only the loss was wanted")


def test_evaluate_makes_no_logits_and_equals_the_plain_trainer(data, tmp_path):
    tokenizer, _, held_out = data
    plain = Trainer(model=_model(len(tokenizer)), args=TrainingArguments(**_args(str(tmp_path / "plain"))),
                    eval_dataset=held_out)
    expected = plain.evaluate()["eval_loss"]
    ours = RoundPipeTrainer(model=_model(len(tokenizer)), eval_dataset=held_out, args=RoundPipeTrainingArguments(
        **_args(str(tmp_path / "rp")), roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=2))
    with mock.patch.object(CausalLMHead, "logits", _no_logits), \
            mock.patch.object(CausalLMHead, "_logits_of_normed", _no_logits):
        got = ours.evaluate()["eval_loss"]
    ours.roundpipe_engine.close()
    # The Trainer keeps the plain run's per-batch losses in float32 (ours come back in float64); the paths themselves
    # agree to 1e-13 (test_skip_logits_equals_the_logits_path).
    assert abs(got - expected) < 1e-6, (got, expected)


def test_compute_metrics_still_gets_the_logits(data, tmp_path):
    """More than the loss wanted: the logits path, as before."""
    tokenizer, _, held_out = data
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {"rows": float(prediction.predictions.shape[0])}

    ours = RoundPipeTrainer(model=_model(len(tokenizer)), eval_dataset=held_out, compute_metrics=compute_metrics,
                            args=RoundPipeTrainingArguments(**_args(str(tmp_path / "rp")),
                                                            roundpipe_devices="cpu", roundpipe_num_microbatches=2))
    metrics = ours.evaluate()
    ours.roundpipe_engine.close()
    assert metrics["eval_rows"] == 10 and seen[0][-1] == len(tokenizer)


@pytest.mark.parametrize("given_count", [False, True])
def test_skip_logits_equals_the_logits_path(data, given_count):
    """`model(**batch, labels=..., skip_logits=True)` under no_grad: logits None, the loss of the logits path, with
    padded labels (-100) over 3 micro-batches, and with HF's `num_items_in_batch` given."""
    tokenizer, _, held_out = data
    engine = wrap_model(_model(len(tokenizer)), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    model = engine.module
    model.eval()
    input_ids = torch.tensor(held_out[:6]["input_ids"])
    labels = input_ids.clone()
    labels[1, :9] = -100
    labels[4, 20:] = -100
    extra = {"num_items_in_batch": torch.tensor(137)} if given_count else {}
    with torch.no_grad():
        fast = model(input_ids=input_ids, labels=labels, skip_logits=True, **extra)
        full = model(input_ids=input_ids, labels=labels, **extra)
    engine.close()
    assert fast.logits is None and full.logits is not None
    # The logits path reduces in float32 as HF's `ForCausalLMLoss` does (`logits.float()`); the head keeps float64,
    # as the training loss does: compare with the float64 loss of the logits path's own logits.
    shifted = labels[:, 1:].flatten()
    total = torch.nn.functional.cross_entropy(full.logits[:, :-1].flatten(0, 1), shifted, reduction="sum")
    count = 137 if given_count else int((shifted != -100).sum())
    assert fast.loss.dtype == torch.float64
    torch.testing.assert_close(fast.loss, total / count, atol=1e-13, rtol=0)
    torch.testing.assert_close(fast.loss.float(), full.loss, atol=1e-6, rtol=0)


def test_forward_loss_refuses_a_last_layer_without_a_loss():
    from accelerate_roundpipe import RoundPipe

    engine = RoundPipe(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=2))
    with pytest.raises(TypeError, match="0-dim loss per micro-batch"):
        engine.forward_loss(torch.randn(4, 3))
    engine.close()
