"""A loss of the model's own ([Note: the model's own loss function] in `models/causal_lm.py`) through
`RoundPipeTrainer` and the Accelerate loop, as a user writes them, against the plain `Trainer` / `Accelerator` on the
same tiny float32 Llama and data: the same losses, gradient norms, evaluation loss and weights after training. A
model class whose own `forward` RoundPipe would never call is refused by name on both ways in."""

from __future__ import annotations

import pytest
import torch
from roundpipe_testing import assert_close_lists
from tiny_llama_model import seeded_tiny_llama
from transformers import LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments, UnsupportedModelError

STEPS = 4
WEIGHT_ATOL = 2e-5  # float32: the two runs sum the same gradients in another order (the micro-batches)


def tripled(*args, **kwargs):
    return 3 * ForCausalLMLoss(*args, **kwargs)


@pytest.fixture(scope="module")
def data():
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    return tokenizer, train, held_out.select(range(8))


def model_with_own_loss(vocab_size: int, way: str):
    model = seeded_tiny_llama(vocab_size)
    if way == "loss_function":
        model.loss_function = tripled  # HF's PreTrainedModel.loss_function setter
    else:
        model.loss_type = "ForMaskedLM"  # another LOSS_MAPPING entry: no shift of the labels
    return model


def trainer_args(output_dir: str) -> dict:
    return dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                dataloader_pin_memory=False)


def logged(trainer, key: str) -> list:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def assert_same_weights(model, expected_model) -> None:
    expected = dict(expected_model.named_parameters())
    worst = max((p.detach() - expected[n].detach()).abs().max().item() for n, p in model.named_parameters())
    assert worst <= WEIGHT_ATOL, f"weights after training differ by {worst:.3g}"


@pytest.mark.parametrize("way", ["loss_function", "loss_type"])
def test_trainer_trains_with_the_models_own_loss(data, tmp_path, way):
    from transformers import Trainer, TrainingArguments

    tokenizer, train, held_out = data
    reference = Trainer(model=model_with_own_loss(len(tokenizer), way),
                        args=TrainingArguments(**trainer_args(str(tmp_path / "plain"))),
                        train_dataset=train, eval_dataset=held_out)
    reference.train()
    expected_eval = reference.evaluate()["eval_loss"]

    args = RoundPipeTrainingArguments(**trainer_args(str(tmp_path / "rp")), roundpipe_devices="cpu,cpu",
                                      roundpipe_num_microbatches=2, roundpipe_async_optimizer=False)
    ours = RoundPipeTrainer(model=model_with_own_loss(len(tokenizer), way), args=args, train_dataset=train,
                            eval_dataset=held_out)
    ours.train()
    assert_close_lists(logged(ours, "loss"), logged(reference, "loss"), "losses")
    assert_close_lists(logged(ours, "grad_norm"), logged(reference, "grad_norm"), "gradient norms", 1e-4)
    assert_close_lists([ours.evaluate()["eval_loss"]], [expected_eval], "evaluation loss")
    ours.roundpipe_engine.synchronize()
    assert_same_weights(ours.model, reference.model)
    ours.roundpipe_engine.close()


def accelerate_loop(accelerator, model, rows, steps: int = STEPS) -> list[float]:
    """The loop of a user's Accelerate script: accumulation over 2 batches, clipping, AdamW."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(rows, batch_size=4, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for _, batch in zip(range(2 * steps), loader):
        with accelerator.accumulate(model):
            out = model(**batch)
            loss = out.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerate_loop_trains_with_the_models_own_loss(data):
    import accelerate

    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    tokenizer, train, _ = data
    rows = [train[i] for i in range(8 * STEPS)]
    reset_accelerate_state()
    reference = model_with_own_loss(len(tokenizer), "loss_function")
    expected = accelerate_loop(accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True), reference, rows)
    reset_accelerate_state()
    accelerator = RoundPipeAccelerator(gradient_accumulation_steps=2, roundpipe_plugin=RoundPipePlugin(
        devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=False))
    model = model_with_own_loss(len(tokenizer), "loss_function")
    losses = accelerate_loop(accelerator, model, rows)
    assert_close_lists(losses, expected, "losses")
    accelerator.roundpipe_engine(model).synchronize()
    assert_same_weights(model, reference)
    accelerator.roundpipe_engine(model).close()
    reset_accelerate_state()


class ZLossLlama(LlamaForCausalLM):
    """A user's subclass adding a z-loss in its own forward, which the engine would never run."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * out.logits.logsumexp(-1).pow(2).mean()
        return out


def z_loss_llama(vocab_size: int):
    from accelerate_roundpipe.tiny.data import tiny_llama_config

    return ZLossLlama(tiny_llama_config(vocab_size))


REFUSED = r"ZLossLlama\.forward` overrides `LlamaForCausalLM\.forward`.*never calls it"


def test_a_model_class_with_its_own_forward_is_refused(data, tmp_path):
    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    tokenizer, train, _ = data
    args = RoundPipeTrainingArguments(**trainer_args(str(tmp_path / "rp")), roundpipe_devices="cpu,cpu",
                                      roundpipe_num_microbatches=2)
    trainer = RoundPipeTrainer(model=z_loss_llama(len(tokenizer)), args=args, train_dataset=train)
    with pytest.raises(UnsupportedModelError, match=REFUSED):
        trainer.train()
    reset_accelerate_state()
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cpu", "cpu"], num_microbatches=2))
    with pytest.raises(UnsupportedModelError, match=REFUSED):
        accelerator.prepare(z_loss_llama(len(tokenizer)))
    reset_accelerate_state()
