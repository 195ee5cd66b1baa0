"""Tiny float32 Llamas, batches and engines for the unit tests of `accelerate_roundpipe.integrations`."""

from __future__ import annotations

import copy

import torch

VOCAB = 64
CPU_WORKERS = dict(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=False)


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.0, tie_word_embeddings=False)
    values.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**values))


def lm_batch(rows: int = 4, seq: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def named_groups(model, weight_decay: float = 0.1) -> list[dict]:
    """Trainer-style groups: no weight decay for norms."""
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def twin(model):
    return copy.deepcopy(model)


def float64_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels=None, **kwargs):
    """transformers' `ForCausalLMLoss` in the logits' own dtype: since transformers 5.25 (at least) it casts the
    logits to float32 first, which leaves a float64 model's gradients float32-accurate, and AdamW's first step then
    differs by up to 2e-6 where a gradient is near zero. Set as `model.loss_function` for float64 parity tests."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                                             ignore_index=ignore_index,
                                             reduction="sum" if num_items_in_batch is not None else "mean")
    return loss / num_items_in_batch if num_items_in_batch is not None else loss

