"""The cost of the head in vocabulary shards against the one-layer fused head, on one GPU (no pipeline).

    python -m benchmarks.head_shards_micro [--tokens 4096] [--hidden 2048] [--vocab 151936] [--shards 1,2,4,8]

For each shard count K: the median time of the head's forward + backward over one micro-batch of `--tokens` tokens
(bf16), K = 1 being `fused_linear_cross_entropy_sum` (the head today), K > 1 the K `_ShardStatistics` calls
chained as the pipeline runs them (forward, then backward from the last shard down), and the forward alone (what an
F stage runs). Prints one JSON line per K.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _time(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times[2:])


def head_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shards: int, chunk: int) -> torch.Tensor:
    """The head's loss sum: the fused head for one shard, else the shards chained as the pipeline chains them."""
    from accelerate_roundpipe.models.fused_ce import fused_linear_cross_entropy_sum
    from accelerate_roundpipe.models.vocab_shards import _ShardStatistics, shard_bounds

    if shards == 1:
        return fused_linear_cross_entropy_sum(x, weight, labels, chunk_tokens=chunk)
    tokens = x.shape[0]
    stats = torch.stack([torch.full((tokens,), -torch.inf, device=x.device),
                         torch.zeros(tokens, device=x.device)], dim=1)
    for start, stop in shard_bounds(weight.shape[0], shards):
        stats = _ShardStatistics.apply(x, weight[start:stop], None, stats, labels, start, chunk)
    return (stats[:, 0] - stats[:, 1]).sum()


def measure(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shards: int, chunk: int) -> dict:
    def forward_backward():
        head_loss(x, weight, labels, shards, chunk).backward()
        x.grad = weight.grad = None

    def forward_only():
        with torch.no_grad():
            head_loss(x, weight, labels, shards, chunk)

    fb, fwd = _time(forward_backward), _time(forward_only)
    flops = 2 * x.shape[0] * x.shape[1] * weight.shape[0]
    return {"shards": shards, "tokens": x.shape[0], "vocab": weight.shape[0], "hidden": x.shape[1],
            "forward_backward_s": round(fb, 5), "forward_s": round(fwd, 5),
            "forward_backward_tflops_of_3_matmuls": round(3 * flops / fb / 1e12, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--shards", default="1,2,4,8")
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device="cuda")).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    for shards in [int(s) for s in args.shards.split(",")]:
        print(json.dumps(measure(x, weight, labels, shards, args.chunk)))


if __name__ == "__main__":
    main()
