"""Engine-core throughput on one GPU beside plain in-GPU PyTorch, measured in the same run.

A stack of residual MLP blocks (d_model 2048, hidden 8192) trained on random data, bf16 compute:
- baseline: the whole model on the GPU (fp32 master weights, bf16 autocast, fused CUDA AdamW);
- roundpipe: RoundPipe with every weight, gradient and optimizer state on the host (bf16 compute copies, fp32
  optimizer copies, fused CPU AdamW, async step).

    python benchmarks/engine_core.py --out benchmarks/results/engine_core.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipe, RoundPipeConfig  # noqa: E402
from benchmarks.commit import git_commit  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(depth: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width, hidden) for _ in range(depth)])


def timed(run_step, warmup: int, iterations: int, sync) -> float:
    for _ in range(warmup):
        run_step()
    sync()
    start = time.perf_counter()
    for _ in range(iterations):
        run_step()
    sync()
    return (time.perf_counter() - start) / iterations


def measure_baseline(args, x, target, device) -> dict:
    """Everything on the GPU: fp32 master weights, bf16 autocast, fused CUDA AdamW."""
    model = build(args.depth, args.width, args.hidden).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    xg, tg = x.to(device), target.to(device)

    def baseline_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(xg).float(), tg)
        loss.backward()
        opt.step()
        opt.zero_grad()

    torch.cuda.reset_peak_memory_stats()
    t = timed(baseline_step, 2, args.iterations, torch.cuda.synchronize)
    return {"s_per_iter": t, "tokens_per_s": args.rows / t, "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/engine_core.json")
    args = parser.parse_args()
    device = torch.device("cuda:0")
    x = torch.randn(args.rows, args.width)
    target = torch.randn(args.rows, args.width)
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "settings": vars(args)}
    results["commit"] = git_commit()
    params = sum(p.numel() for p in build(1, args.width, args.hidden).parameters()) * args.depth
    results["params"] = params

    results["baseline"] = measure_baseline(args, x, target, device)
    torch.cuda.empty_cache()

    engine = RoundPipe(build(args.depth, args.width, args.hidden).bfloat16(),
                       RoundPipeConfig(devices=["cuda:0"], num_microbatches=args.microbatches))
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-5))
    xb, tb = x.bfloat16(), target.bfloat16()

    def engine_step():
        engine.forward_backward(xb, labels=tb, loss_fn=lambda out, y: nn.functional.mse_loss(out.float(), y.float()))
        opt.step()
        opt.zero_grad()

    torch.cuda.reset_peak_memory_stats()
    t = timed(engine_step, 2, args.iterations, engine.synchronize)
    results["roundpipe"] = {"s_per_iter": t, "tokens_per_s": args.rows / t,
                            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}
    engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
