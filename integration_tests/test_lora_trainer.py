"""LoRA through `RoundPipeTrainer`: trained like Trainer trains it, adapters saved alone and reloaded."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from roundpipe_testing import assert_close_lists

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

peft = pytest.importorskip("peft")


def lora_model(vocab_size: int):
    from transformers import LlamaForCausalLM, set_seed

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    set_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(vocab_size))
    pristine = copy.deepcopy(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(base, config), pristine


def test_lora_trains_like_trainer_and_adapters_reload(tmp_path):
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    common = dict(max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                  save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                  dataloader_pin_memory=False)

    model, _ = lora_model(len(tokenizer))
    reference = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "plain"), **common),
                        train_dataset=train)
    reference.train()

    model, pristine_base = lora_model(len(tokenizer))
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out = str(tmp_path / "rp")
    args = RoundPipeTrainingArguments(output_dir=out, roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=2,
                                      roundpipe_async_optimizer=False, **common)
    ours = RoundPipeTrainer(model=model, args=args, train_dataset=train)
    ours.train()
    losses = [e["loss"] for e in ours.state.log_history if "loss" in e]
    assert_close_lists(losses, [e["loss"] for e in reference.state.log_history if "loss" in e], "LoRA losses")
    # Only the adapters have optimizer copies; the frozen base never moved.
    stepped = [p for group in ours.optimizer.param_groups for p in group["params"]]
    assert stepped and len(stepped) == sum(p.requires_grad for p in model.parameters())
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)

    ours.save_model()
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)

    batch = held_out.with_format("torch")[:4]
    model.eval()
    with torch.no_grad():
        trained_logits = model(input_ids=batch["input_ids"]).logits  # forward pipeline on RoundPipe
    ours.roundpipe_engine.close()
    reloaded = peft.PeftModel.from_pretrained(pristine_base, out).eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(reloaded_logits, trained_logits, atol=1e-5, rtol=0)
