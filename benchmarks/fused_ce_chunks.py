"""The head's fused linear cross-entropy on one GPU, by chunk size, beside its matrix work alone.

    python -m benchmarks.fused_ce_chunks [--tokens 16384] [--chunks 1024,2048,4096,8192] [--out FILE]

Why: traced under the 24 GiB cap, the head stage took about 3x its matrix work (Qwen3-4B 0.29 s, Llama-3.1-8B LoRA
0.43 s a step: docs/benchmarks.md, "Dense models under the 24 GiB cap"). For the head shapes of the paper's models
(hidden x vocabulary) and one micro-batch of `--tokens` tokens in bf16, this times `fused_linear_cross_entropy_sum`'s
forward + backward with the head weight trainable (full fine-tuning) and frozen (LoRA), at each chunk size, and the
same matrix products without the softmax (`matmuls`: logits, grad_hidden and, trainable, grad_weight), then lists the
top kernels of the 1,024-token run. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS = {"qwen3-4b": (2560, 151936), "llama3.1-8b": (4096, 128256), "qwen3-30b-a3b": (2048, 151936)}


def _time(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times[2:])


def _fused(hidden, weight, labels, chunk: int):
    from accelerate_roundpipe.models.fused_ce import fused_linear_cross_entropy_sum

    def run():
        h = hidden.detach().requires_grad_(True)
        loss = fused_linear_cross_entropy_sum(h, weight, labels, chunk_tokens=chunk)
        loss.backward()
        weight.grad = None
    return run


def _matmuls(hidden, weight, chunk: int):
    def run():
        for start in range(0, hidden.shape[0], chunk):
            part = hidden[start:start + chunk]
            logits = part @ weight.t()
            _ = logits @ weight
            if weight.requires_grad:
                _ = logits.t() @ part
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunks", default="1024,2048,4096,8192")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    lines = []
    for name, (hidden_size, vocab) in HEADS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(args.tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        labels = torch.randint(0, vocab, (args.tokens,), device="cuda", generator=gen)
        for trainable in (True, False):
            weight = (torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
            weight.requires_grad_(trainable)
            matrix_s = _time(_matmuls(hidden, weight.detach().requires_grad_(trainable), 4096))
            for chunk in chunks:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                seconds = _time(_fused(hidden, weight, labels, chunk))
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                line = {"head": name, "hidden": hidden_size, "vocab": vocab, "tokens": args.tokens,
                        "weight": "trainable" if trainable else "frozen", "chunk_tokens": chunk,
                        "fused_s": round(seconds, 5), "matmuls_s": round(matrix_s, 5),
                        "of_matmuls": round(seconds / matrix_s, 2), "peak_extra_gib": round(peak, 2)}
                print(json.dumps(line), flush=True)
                lines.append(line)
            del weight
    hidden_size, vocab = HEADS["llama3.1-8b"]
    hidden = torch.randn(args.tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (args.tokens,), device="cuda")
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02
    run = _fused(hidden, weight, labels, 1024)
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
