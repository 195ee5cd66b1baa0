"""Where a dense decoder layer's GPU time goes, the engine beside HF + Liger on the same layers (issue 32 item 4: the
dense runs under the 24 GiB cap are compute-bound at 0.44 of the limit, the compute track 91-100% busy; is it the
engine's kernels, its recomputation, or the layers' own kernels that HF + Liger runs as slowly?).

A Qwen3 (a Llama for `llama3.1-8b`) built from a config with `--model`'s layer shapes (Qwen3-4B by default; a
vocabulary of 32,000 so the head does not dominate), `--layers` decoder layers, bf16, `--batch` rows of `--seq`
tokens (one micro-batch of the b8 run under the cap), on the whole GPU. Every system trains every parameter (or the
adapters, `--lora`) with AdamW (lr 0: the weights stay equal, so
each profiled step computes the same numbers) and is profiled by `moe_layer_profile.profile_steps` (wall and GPU
busy time a step, kernels by kind, the operators that launched the most GPU time):
- `hf-liger`: HF with Liger's kernels on the instance (what the in-GPU anchor runs), no checkpointing;
- `hf-liger-ckpt`: the same with HF's gradient checkpointing (each layer's forward recomputed in the backward);
- `engine`: the engine at its defaults on the whole GPU (optimizer placement auto: the state on the GPU; a fused
  pass of all the layers, which recomputes nothing);
- `engine-stages`: the engine with one layer a backward stage (`backward_stages`), so every layer below the fused
  one is recomputed as under the cap: the kernels a step under the cap runs, without its uploads.
The engine's rows against HF's at the same recomputation say what the engine's own work costs on the GPU. With
`--lora`, every system trains PEFT LoRA r16 (alpha 32) on q, k, v, o, gate, up and down instead, the adapters in bf16
as the in-GPU anchor's (the Llama-3.1-8B LoRA run under the cap: 100% busy at 0.42 of the limit).

    python3 benchmarks/dense_layer_profile.py [--model qwen3-4b] [--layers 4] [--batch 4] [--seq 4096]
        [--systems hf-liger,hf-liger-ckpt,engine,engine-stages] [--lora] [--out results.jsonl]
    python3 benchmarks/dense_layer_profile.py --tiny   # CPU, tiny shapes: that it runs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.models import init_weights, make_batch  # noqa: E402
from benchmarks.moe_layer_profile import profile_steps  # noqa: E402
from benchmarks.records import emit  # noqa: E402

# Layer shapes (the decoder's; the vocabulary is the script's own).
SHAPES = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128),
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
# "-peft-adds": the engine with PEFT's own LoRA forward on its layer copies (three passes over each linear's output)
# instead of the product added inside one GEMM ([Note: LoRA added in the GEMM]), to measure the two in one call.
SYSTEMS = ("hf-liger", "hf-liger-ckpt", "engine", "engine-stages", "engine-peft-adds", "engine-stages-peft-adds")
VOCAB = 32000


def build_model(model: str, layers: int, seq: int, device: str, dtype: torch.dtype, vocab: int):
    import transformers

    family = "Llama" if model.startswith("llama") else "Qwen3"
    config = getattr(transformers, f"{family}Config")(**SHAPES[model], num_hidden_layers=layers, vocab_size=vocab,
                                                      max_position_embeddings=max(seq, 4096), use_cache=False,
                                                      tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        built = getattr(transformers, f"{family}ForCausalLM")(config).to(dtype)
    init_weights(built, torch.Generator(device).manual_seed(0))
    return built.train()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, config).to(dtype)


def hf_step(model, batch: dict, fused: bool):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0, fused=fused)

    def step():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def engine_step(model, batch: dict, device: str, layers: int, stages: bool):
    """The engine over `model` (moved to the host) and its step; close the engine afterwards."""
    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    settings = dict(devices=[device], async_optimizer=False, num_microbatches=1)
    if stages:  # embedding + decoder layers + head: the pipeline's layers, one a backward stage
        settings["backward_stages"] = [1] * (layers + 2)
    engine = wrap_model(model.to("cpu"), RoundPipeConfig(**settings))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad],
                                                        lr=0.0, fused=device.startswith("cuda")))

    def step():
        loss = engine.forward_backward(**batch)
        optimizer.step()
        optimizer.zero_grad()
        engine.wait_for_work()  # not synchronize(): its look downloads every GPU-stepped bucket, which no loop does
        return loss
    return engine, step


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a check that the script runs)")
    parser.add_argument("--model", default="qwen3-4b", choices=sorted(k for k in SHAPES if k != "tiny"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="rows per step (one micro-batch of the b8 run under "
                        "the cap: 2 of 4 rows)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; --tiny: 32)")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--lora", action="store_true", help="train LoRA r16 on every linear (PEFT) instead")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    args.seq = args.seq or (32 if args.tiny else 4096)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")
    os.environ.setdefault("ROUNDPIPE_SUMMARY", "0")
    model_name, device = ("tiny", "cpu") if args.tiny else (args.model, "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    vocab = 256 if args.tiny else VOCAB
    batch = make_batch(vocab, args.batch, args.seq)
    on_device = {k: v.to(device) for k, v in batch.items()}
    tokens = args.batch * args.seq
    base = {"bench": "dense-layer-profile", "model": model_name, "batch": args.batch, "seq": args.seq,
            "layers": args.layers, "training": "lora r16" if args.lora else "full",
            "commit": os.environ.get("BENCH_COMMIT", "unknown")}
    records = []

    def report(system: str, result: dict) -> None:
        record = {**base, "system": system, "tokens_per_s": round(tokens / result["wall_ms"] * 1e3, 1), **result}
        emit(record, args.out)
        records.append(record)

    for system in systems:
        model = build_model(model_name, args.layers, args.seq, device, dtype, vocab)
        if system.startswith("hf"):
            if device.startswith("cuda"):
                from liger_kernel.transformers import _apply_liger_kernel_to_instance
                _apply_liger_kernel_to_instance(model=model)
            if system == "hf-liger-ckpt":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if args.lora:
                    model.enable_input_require_grads()  # the checkpointed layers' inputs need grad (PEFT's recipe)
            if args.lora:
                model = with_lora(model, dtype)
            report(system, profile_steps(hf_step(model, on_device, device.startswith("cuda")), args.warm,
                                         args.steps, device))
        else:
            if args.lora:
                model = with_lora(model, dtype)
            from accelerate_roundpipe.compat import peft_linear

            peft_linear.enabled = not system.endswith("-peft-adds")
            engine, step = engine_step(model, batch, "cpu" if device == "cpu" else "cuda:0", args.layers,
                                       stages=system.startswith("engine-stages"))
            try:
                result = profile_steps(step, args.warm, args.steps, device)
                report(system, {**result, "partition": str(engine.partition)})  # the stages the profiled steps ran
            finally:
                engine.close()
                peft_linear.enabled = True
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    main()
