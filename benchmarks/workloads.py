"""The benchmark workloads: a model shape, full fine-tune or LoRA, the sequence lengths, the global batch and the
emulated card size. Shapes are the planner's (`accelerate_roundpipe.plan.decoder_shapes.MODEL_SHAPES`); what a
Hugging Face config needs beyond them is in `HF_CONFIGS`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from accelerate_roundpipe.plan.decoder_shapes import MODEL_SHAPES, DecoderShape

# A two-layer model for CPU runs of the command line; not a published model.
SHAPES = {**MODEL_SHAPES, "tiny-llama": DecoderShape(32, 64, 2, 4, 2, 8, 64, False)}

# Per shape: the transformers config class and the fields MODEL_SHAPES does not hold (each model's config.json).
_QWEN3 = dict(max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
HF_CONFIGS = {
    "qwen3-1.7b": ("Qwen3Config", _QWEN3),
    "qwen3-4b": ("Qwen3Config", _QWEN3),
    "llama3.1-8b": ("LlamaConfig", dict(
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "tiny-llama": ("LlamaConfig", dict(max_position_embeddings=4096)),
}

# LoRA as the anchors run it: r=16, alpha 32, no dropout, on every linear layer of the decoder.
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Workload:
    arch: str  # a key of SHAPES
    seqs: tuple[int, ...]  # swept upwards, up to the first failure, in workloads `is_sweep` names so
    global_batch: int
    lora: bool = False
    cap_gib: float = 0.0  # the card emulated (set_per_process_memory_fraction); 0: the whole GPU

    @property
    def shape(self) -> DecoderShape:
        return SHAPES[self.arch]


WORKLOADS = {
    "qwen3-1.7b-full-s4096-b8": Workload("qwen3-1.7b", (4096,), 8),
    "qwen3-4b-full-s4096-b8-cap24": Workload("qwen3-4b", (4096,), 8, cap_gib=24.0),
    "llama3.1-8b-lora-s4096-b8": Workload("llama3.1-8b", (4096,), 8, lora=True),
    "llama3.1-8b-lora-s4096-b8-cap24": Workload("llama3.1-8b", (4096,), 8, lora=True, cap_gib=24.0),
    # the longest sequence that trains at batch 1 on a 24 GiB card
    "qwen3-1.7b-cap24-b1": Workload("qwen3-1.7b", (4096, 8192, 16384, 32768, 65536, 131072), 1, cap_gib=24.0),
    # CPU runs of the command line (tests)
    "tiny-llama-full-s16-b4": Workload("tiny-llama", (16,), 4),
    "tiny-llama-cap1-b1": Workload("tiny-llama", (16, 32), 1, cap_gib=1.0),
}


def is_sweep(workload: str) -> bool:
    """Workloads named `<model>-cap<GiB>-b1` (ours and the anchors' alike) are sequence-length sweeps."""
    return re.search(r"-cap[0-9.]+-b1$", workload) is not None
