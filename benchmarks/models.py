"""The benchmark model of a workload (random init, in the layout a user's Hugging Face model has) and its batch."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from benchmarks.workloads import ATTENTION, HF_CONFIGS, LORA_ALPHA, LORA_RANK, SHAPES, MoeShape, lora_targets


def hf_config(arch: str, seq: int):
    """The transformers config of an arch: a dense shape with its extra fields, a mixture of experts' whole config;
    no cache, the arch's attention, positions for `seq`."""
    import transformers

    config_cls, extra = HF_CONFIGS[arch]
    shape = SHAPES[arch]
    fields = extra if isinstance(shape, MoeShape) else {**dataclasses.asdict(shape), **extra}
    # a copy: transformers writes into the dicts it is given (rope_theta into rope_scaling)
    config = getattr(transformers, config_cls)(**copy.deepcopy(fields))
    config.use_cache = False
    config._attn_implementation = ATTENTION.get(arch, "sdpa")
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    return config


def lora_config(arch: str):
    """LoRA as the anchors run it (r 16, alpha 32, no dropout) on the arch's targets (`lora_targets`)."""
    from peft import LoraConfig

    targets = lora_targets(arch)
    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets["target_modules"],
                      target_parameters=targets["target_parameters"] or None, task_type="CAUSAL_LM")


@contextlib.contextmanager
def cap_lifted():
    """The whole GPU while the model is built on it (a 30B model cannot be initialised inside an emulated 24 GiB
    card; the engine keeps it on the host), then the cap set back, the build's cache released first so that the
    run starts from an empty allocator. Nothing to do without a GPU."""
    if not torch.cuda.is_available():
        yield
        return
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(fraction, 0)


def build_model(arch: str, seq: int, lora: bool, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Random init (N(0, 0.02) matrices, norms 1, in place) in `dtype` on the GPU when there is one (fast; with the
    emulated card's cap lifted, `cap_lifted`), LoRA added, then moved to the CPU, where a user's loaded model would
    be (the engine keeps the weights there). No float32 copy of the weights is made: the model is created in
    `dtype`; only PEFT's adapters start in float32, then are cast."""
    import transformers

    config = hf_config(arch, seq)
    build_on = "cuda" if torch.cuda.is_available() else "cpu"
    with cap_lifted():
        with torch.device(build_on):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        init_weights(model)
        if lora:  # PEFT makes its adapters on the CPU and moves them beside their layers
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(arch))
            model = model.to(dtype)  # adapters in the model dtype too: all three ways in then compute the same
        model = model.to("cpu")
    model.train()
    return model


def init_weights(model: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """The benchmarks' random init, in place: N(0, 0.02) matrices, norms 1, the rest 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)


def make_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict:
    """Random token ids, every position attended and trained on."""
    ids = torch.randint(0, vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
