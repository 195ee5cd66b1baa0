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
