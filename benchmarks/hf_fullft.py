"""Full fine-tune throughput of a Hugging Face model architecture (random init) on RoundPipe, one GPU.

Every parameter, gradient and optimizer state stays on the host (bf16 compute copies, fp32 optimizer copies, fused
CPU AdamW, async step). Run the anchors of ../shared/anchors beside it in the same device call for the baselines.

    python benchmarks/hf_fullft.py --model qwen3-1.7b --seq 4096 --gb 8 --nms 4,8 --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipeConfig, wrap_model  # noqa: E402

# Published architecture numbers (the models' config.json files).
ARCHITECTURES = {
    "qwen3-1.7b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen3-4b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def build(name: str, seq: int):
    import transformers

    config_cls, model_cls, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**kwargs, max_position_embeddings=max(40960, seq), use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device("cpu"):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    return model


def run(args, num_microbatches: int) -> dict:
    model = build(args.model, args.seq)
    layers = model.config.num_hidden_layers + 2  # embedding, decoder layers, head
    stages = {"backward_stages": [layers]} if args.fused_all else {}
    engine = wrap_model(model, RoundPipeConfig(devices=["cuda:0"], num_microbatches=num_microbatches,
                                               kernels=args.kernels, recompute=args.recompute, **stages))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-5, weight_decay=0.0))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.gb, args.seq), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    torch.cuda.reset_peak_memory_stats()
    times = []
    profiler = None
    for step in range(args.warm + args.iters):
        if step == args.warm:
            engine.synchronize()
            start = time.perf_counter()
            if args.profile:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.__enter__()
        tick = time.perf_counter()
        loss = engine.forward_backward(**batch)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - tick)
        print(f"[ours nms={num_microbatches}] step {step} loss {loss.item():.4f} {times[-1]:.3f} s", flush=True)
    engine.synchronize()
    median = (time.perf_counter() - start) / args.iters  # steady state, the lagged step included
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        print(table, flush=True)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                            max_name_column_width=60), flush=True)
    result = {"system": "accelerate_roundpipe", "model": args.model, "seq": args.seq, "gb": args.gb,
              "nms": num_microbatches, "iter_s": round(median, 4), "fused_all": args.fused_all,
              "kernels": args.kernels, "liger": engine.fused_kernels, "recompute": args.recompute,
              "partition": str(engine.partition),
              "tokens_per_s": round(args.gb * args.seq / median, 1),
              "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "torch": torch.__version__,
              "torch_threads": torch.get_num_threads()}
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gb", type=int, default=8)
    parser.add_argument("--nms", default="4,8", help="micro-batch counts to sweep")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/hf_fullft.jsonl")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for the host work (default: torch's own choice)")
    parser.add_argument("--fused-all", action="store_true", help="every layer in the fused stage (no recompute)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "liger", "none"])
    parser.add_argument("--recompute", default="stage", choices=["stage", "layer"])
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of the timed steps")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    for nms in (int(v) for v in args.nms.split(",")):
        result = run(args, nms)
        print("RESULT", json.dumps(result), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
