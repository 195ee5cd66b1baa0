"""How fast the host can run the optimizer step, against how fast it can move memory at all.

The exact (sync) step's host work is torch's fused CPU AdamW over every trainable parameter (float32 weight,
gradient and two moments: 16 bytes read and 12 written per parameter). This measures, on the machine it runs on,
with torch's own intra-op threads:
- `copy`: `dst.copy_(src)` over buffers far larger than the caches (bytes read + written per second);
- `triad`: `torch.add(a, b, alpha=s, out=c)`, two reads and one write, the STREAM triad;
- `adamw`: fused AdamW steps over layer-sized float32 parameters, in parameters per second and bytes per second.
AdamW's bytes per second against `triad`'s says whether the step is memory-bound (close to it: nothing left to gain
from the kernel; only fewer bytes or more memory bandwidth make it faster).

    python3 benchmarks/host_roofline.py [--gib 2] [--layer-params 50e6] [--layers 8] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.records import emit  # noqa: E402

ADAMW_BYTES_PER_PARAM = 16 + 12  # reads weight, grad, exp_avg, exp_avg_sq; writes weight, exp_avg, exp_avg_sq


def best_rate(fn, bytes_moved: float, repeats: int) -> float:
    """Bytes per second of the fastest of `repeats` runs of `fn` (after one warm-up run)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return bytes_moved / best


def memory_rates(gib: float, repeats: int) -> dict[str, float]:
    n = int(gib * 2**30 / 4)
    a, b, c = (torch.ones(n) for _ in range(3))
    copy = best_rate(lambda: c.copy_(a), 2 * 4 * n, repeats)
    triad = best_rate(lambda: torch.add(a, b, alpha=0.5, out=c), 3 * 4 * n, repeats)
    return {"copy_gb_s": copy / 1e9, "triad_gb_s": triad / 1e9}


def adamw_rate(layer_params: int, layers: int, repeats: int) -> dict[str, float]:
    params = [torch.nn.Parameter(torch.randn(layer_params)) for _ in range(layers)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    total = layer_params * layers
    rate = best_rate(optimizer.step, total * ADAMW_BYTES_PER_PARAM, repeats)
    return {"adamw_gb_s": rate / 1e9, "adamw_params_per_s": rate / ADAMW_BYTES_PER_PARAM,
            "adamw_ms_per_layer": layer_params * ADAMW_BYTES_PER_PARAM / rate * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of each buffer of the memory tests")
    parser.add_argument("--layer-params", type=float, default=50e6, help="parameters per AdamW tensor")
    parser.add_argument("--layers", type=int, default=8, help="AdamW tensors stepped per step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="append the record (JSON lines) here")
    args = parser.parse_args()
    record = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "commit": os.environ.get("BENCH_COMMIT", "unknown")}
    record.update(memory_rates(args.gib, args.repeats))
    record.update(adamw_rate(int(args.layer_params), args.layers, args.repeats))
    record["adamw_of_triad"] = record["adamw_gb_s"] / record["triad_gb_s"]
    emit(record, args.out, label="host roofline", digits=3)


if __name__ == "__main__":
    main()
