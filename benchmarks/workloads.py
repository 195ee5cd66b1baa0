"""The benchmark workloads: a model shape, full fine-tune or LoRA, the sequence lengths, the global batch and the
emulated card size. Dense shapes are the planner's (`accelerate_roundpipe.plan.decoder_shapes.MODEL_SHAPES`); what
a Hugging Face config needs beyond them is in `HF_CONFIGS`. Mixtures of experts (`MoeShape`) have their whole
config here, as the anchors build them (`../shared/anchors/common.py`), and their shape read from it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from accelerate_roundpipe.plan.decoder_shapes import MODEL_SHAPES, DecoderShape


@dataclass(frozen=True)
class MoeShape(DecoderShape):
    """A decoder whose every MLP is `num_experts` experts behind a router (hidden x experts), each a fused gate and
    up matrix (hidden x 2 `moe_intermediate_size`) and a down one, of which `num_experts_per_tok` run per token.
    `sliding_layers` of the layers attend to the last `sliding_window` tokens only. `expert_lora_ranks`: the rank of
    the arch's usual LoRA (`LORA_RECIPES`) on gate_up_proj and down_proj, in multiples of r, as PEFT builds it
    (Qwen3-MoE's gate_proj and up_proj adapters fused into one of rank 2r by PEFT's transformers-5 conversion)."""

    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int = 0
    sliding_layers: int = 0
    expert_lora_ranks: tuple[int, int] = (1, 1)


# Published configs (each model's config.json), exactly as the anchors' common.py builds them.
QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B: 128 experts, 8 active
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, vocab_size=151936, tie_word_embeddings=False,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
)
GPT_OSS_20B = dict(  # openai/gpt-oss-20b (weights in bf16 here, not MXFP4): 32 experts, 4 active
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, tie_word_embeddings=False,
    max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
)
# Two-layer models for CPU runs of the command line (tests); not published models.
TINY_QWEN3_MOE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, vocab_size=64, tie_word_embeddings=False, max_position_embeddings=4096)
TINY_GPT_OSS = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=64,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                    max_position_embeddings=4096)


def _moe_shape(config: dict, expert_lora_ranks: tuple[int, int]) -> MoeShape:
    """The shape of a Qwen3-MoE or GPT-OSS config (GPT-OSS names its experts num_local_experts and their width
    intermediate_size); refused if some layers are dense, which the FLOP count does not know."""
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("MoeShape counts every layer as a mixture of experts: the config has dense layers")
    gpt_oss = "num_local_experts" in config
    layer_types = config.get("layer_types", [])
    return MoeShape(config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                    config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                    config["vocab_size"], config["tie_word_embeddings"],
                    moe_intermediate_size=config["intermediate_size" if gpt_oss else "moe_intermediate_size"],
                    num_experts=config["num_local_experts" if gpt_oss else "num_experts"],
                    num_experts_per_tok=config["num_experts_per_tok"],
                    sliding_window=config.get("sliding_window") or 0,
                    sliding_layers=layer_types.count("sliding_attention"), expert_lora_ranks=expert_lora_ranks)


SHAPES = {**MODEL_SHAPES, "tiny-llama": DecoderShape(32, 64, 2, 4, 2, 8, 64, False),
          "qwen3-30b-a3b": _moe_shape(QWEN3_30B_A3B, (2, 1)), "gpt-oss-20b": _moe_shape(GPT_OSS_20B, (1, 1)),
          "tiny-qwen3-moe": _moe_shape(TINY_QWEN3_MOE, (2, 1)), "tiny-gpt-oss": _moe_shape(TINY_GPT_OSS, (1, 1))}

# Per arch: the transformers config class and, for dense shapes, the fields SHAPES does not hold (each model's
# config.json); for mixtures of experts, every field (MoeShape's names are not the config's).
_QWEN3 = dict(max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
HF_CONFIGS = {
    "qwen3-1.7b": ("Qwen3Config", _QWEN3),
    "qwen3-4b": ("Qwen3Config", _QWEN3),
    "qwen3-32b": ("Qwen3Config", _QWEN3),
    "llama3.1-8b": ("LlamaConfig", dict(
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "tiny-llama": ("LlamaConfig", dict(max_position_embeddings=4096)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B),
    "gpt-oss-20b": ("GptOssConfig", GPT_OSS_20B),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", TINY_QWEN3_MOE),
    "tiny-gpt-oss": ("GptOssConfig", TINY_GPT_OSS),
}
# The attention each arch runs (default sdpa): transformers' GPT-OSS has no sdpa path (its attention sinks).
ATTENTION = {"gpt-oss-20b": "eager", "tiny-gpt-oss": "eager"}

# LoRA as the anchors run it: r=16, alpha 32, no dropout, on every linear layer of the decoder.
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Per arch, PEFT's targets when not LORA_TARGETS. On transformers 5, Qwen3-MoE's gate/up/down names reach its fused
# experts (PEFT maps them onto mlp.experts.gate_up_proj and down_proj, its ParamWrapper); GPT-OSS's usual recipe
# names the experts' parameters and the attention.
_GPT_OSS_LORA = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
LORA_RECIPES = {"gpt-oss-20b": _GPT_OSS_LORA, "tiny-gpt-oss": _GPT_OSS_LORA}


def lora_targets(arch: str) -> dict:
    """PEFT's `target_modules` and `target_parameters` for the arch's LoRA."""
    recipe = LORA_RECIPES.get(arch, {})
    return {"target_modules": list(recipe.get("target_modules", LORA_TARGETS)),
            "target_parameters": list(recipe.get("target_parameters", []))}


@dataclass(frozen=True)
class Workload:
    arch: str  # a key of SHAPES
    seqs: tuple[int, ...]  # swept upwards, up to the first failure, in workloads `is_sweep` names so
    global_batch: int
    lora: bool = False
    cap_gib: float = 0.0  # the card emulated (set_per_process_memory_fraction); 0: the whole GPU
    # forward_backward calls a step (gradient accumulation across calls, each global_batch / accumulation rows);
    # only the engine runner (benchmarks/runners/engine.py) accumulates
    accumulation: int = 1

    @property
    def shape(self) -> DecoderShape:
        return SHAPES[self.arch]


WORKLOADS = {
    "qwen3-1.7b-full-s4096-b8": Workload("qwen3-1.7b", (4096,), 8),
    "qwen3-4b-full-s4096-b8-cap24": Workload("qwen3-4b", (4096,), 8, cap_gib=24.0),
    # issue 33's disk-tier target: a global batch of 64 rows by gradient accumulation, 8 calls of 8 rows a step, so
    # the optimizer state read and written a step is spread over 8x the tokens of b8. (One pass of 64 rows saved
    # 36 layer inputs of 1.25 GiB on the host and planned 64 one-row micro-batches that did not fit the card.)
    "qwen3-4b-full-s4096-b64-cap24": Workload("qwen3-4b", (4096,), 64, cap_gib=24.0, accumulation=8),
    "llama3.1-8b-lora-s4096-b8": Workload("llama3.1-8b", (4096,), 8, lora=True),
    # the disk tier's (host_memory_budget=96): a full fine-tune whose 134 GiB of host state does not fit 96 GiB
    "llama3.1-8b-full-s4096-b8": Workload("llama3.1-8b", (4096,), 8),
    "llama3.1-8b-lora-s4096-b8-cap24": Workload("llama3.1-8b", (4096,), 8, lora=True, cap_gib=24.0),
    # the same full fine-tune on a 24 GiB card (issue 33's target: host_memory_budget=96, the rest on disk)
    "llama3.1-8b-full-s4096-b8-cap24": Workload("llama3.1-8b", (4096,), 8, cap_gib=24.0),
    # and at issue 33's global batch, 8 calls of 8 rows a step
    "llama3.1-8b-full-s4096-b64-cap24": Workload("llama3.1-8b", (4096,), 64, cap_gib=24.0, accumulation=8),
    # the paper's big models on a 24 GiB card: two mixtures of experts and a dense 32B, LoRA
    "qwen3-30b-a3b-lora-s4096-b8-cap24": Workload("qwen3-30b-a3b", (4096,), 8, lora=True, cap_gib=24.0),
    "qwen3-30b-a3b-lora-s4096-b32-cap24": Workload("qwen3-30b-a3b", (4096,), 32, lora=True, cap_gib=24.0),
    "gpt-oss-20b-lora-s4096-b8-cap24": Workload("gpt-oss-20b", (4096,), 8, lora=True, cap_gib=24.0),
    "qwen3-32b-lora-s4096-b8-cap24": Workload("qwen3-32b", (4096,), 8, lora=True, cap_gib=24.0),
    # the longest sequence that trains at batch 1 on a 24 GiB card
    "qwen3-1.7b-cap24-b1": Workload("qwen3-1.7b", (4096, 8192, 16384, 32768, 65536, 131072), 1, cap_gib=24.0),
    # CPU runs of the command line (tests)
    "tiny-llama-full-s16-b4": Workload("tiny-llama", (16,), 4),
    "tiny-llama-cap1-b1": Workload("tiny-llama", (16, 32), 1, cap_gib=1.0),
    "tiny-qwen3-moe-lora-s16-b4": Workload("tiny-qwen3-moe", (16,), 4, lora=True),
    "tiny-gpt-oss-lora-s16-b4": Workload("tiny-gpt-oss", (16,), 4, lora=True),
}


def is_sweep(workload: str) -> bool:
    """Workloads named `<model>-cap<GiB>-b1` (ours and the anchors' alike) are sequence-length sweeps."""
    return re.search(r"-cap[0-9.]+-b1$", workload) is not None
