"""The benchmark model of a workload (random init, in the layout a user's Hugging Face model has) and its batch."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.workloads import HF_CONFIGS, LORA_ALPHA, LORA_RANK, LORA_TARGETS, SHAPES


def build_model(arch: str, seq: int, lora: bool, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Random init (N(0, 0.02) matrices, norms 1) on the GPU when there is one (fast), then moved to the CPU, where a
    user's loaded model would be."""
    import transformers

    config_cls, extra = HF_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**dataclasses.asdict(SHAPES[arch]), **extra)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    build_on = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(build_on):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
        model = model.to(dtype)  # adapters in the model dtype too: all three ways in then compute the same
    model = model.to("cpu")
    if build_on == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    model.train()
    return model


def make_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict:
    """Random token ids, every position attended and trained on."""
    ids = torch.randint(0, vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
