"""Where a mixture-of-experts step's GPU time goes: kernels by kind, for plain HF, PEFT LoRA in GPU memory and the
engine's LoRA (issue 32: the b32 run is compute-bound at 0.22 of the limit; is it the experts' matrix products, the
routing around them, attention, or the gaps between kernels?).

The model of `benchmarks/moe_experts.py` (Qwen3-30B-A3B's layer shapes, 4 decoder layers, bf16) at `--batch` rows of
`--seq` tokens, which is one micro-batch of the b32 run (4 rows of 4096) by default. For each system, `--steps`
profiled steps after `--warm`: the GPU's busy time per step, the wall time per step, and the kernels' time by kind
(the experts' grouped GEMM, other GEMMs, attention, the routing's sort/scatter/gather/index kernels, elementwise
and reductions, copies), with the top kernels by time. The engine's rows include its stage recomputation (a fused
pass of all 4 layers has none on the whole GPU; `--recompute` names the config value to force it).

    python3 benchmarks/moe_layer_profile.py [--batch 4] [--seq 4096] [--steps 3] [--systems hf,peft,engine]
        [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import trace_summary  # noqa: E402
from benchmarks.moe_experts import FULL, LORA_TARGETS, TINY, build_model, make_batch  # noqa: E402
from benchmarks.records import emit  # noqa: E402
from benchmarks.trace_summary import GPU_CATEGORIES, all_threads_config, union_length  # noqa: E402

# Kinds of kernels, by a word of their name; the first that matches wins (lower case).
KINDS = (
    ("experts grouped GEMM", ("grouped", "_grouped_mm", "cutlass")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("GEMM", ("gemm", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("routing (sort, index, scatter, histogram)", ("sort", "index", "scatter", "gather", "histc", "bincount",
                                                   "cumsum", "topk", "radix", "unique", "nonzero")),
    ("copies and casts", ("copy", "memcpy", "memset", "cast")),
    ("reductions", ("reduce", "softmax", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    for kind, words in KINDS:
        if any(word in lower for word in words):
            return kind
    return "other"


def profile_steps(step, warm: int, steps: int, device: str) -> dict:
    """Run `warm` steps, then `steps` under torch.profiler: wall and GPU time per step, kernels by kind."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        step()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # Python frames only on the GPU: the rows' "where" is what they are for, on the CPU (the suite's tiny runs) they
    # named nothing and grouping the operators by them took 4-5 s a system.
    with profile(activities=activities, record_shapes=True, with_stack=cuda,
                 experimental_config=all_threads_config()) as prof:
        start = time.perf_counter()
        losses = [float(step()) for _ in range(steps)]
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
        thread_names = {str(t.native_id): t.name for t in threading.enumerate()}
    # Kernel times from the exported trace (the path benchmarks/trace_summary.py reads), one event per kernel.
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    by_kind: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    for event in kernels:
        by_kind[kind_of(event["name"])] += float(event.get("dur", 0.0)) / 1e3 / steps
        by_kernel[event["name"][:160]] += float(event.get("dur", 0.0)) / 1e3 / steps
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in kernels)
    busy = union_length(spans) / 1e3 / steps
    # Where the GPU waited: its idle gaps and what each host thread ran meanwhile (the engine's task hand-overs).
    waits = trace_summary.summarize({"traceEvents": events}, steps, top=10, thread_names=thread_names)
    idle = {key: waits[key] for key in ("idle_gaps_per_step", "idle_gap_ms_per_step", "longest_idle_gaps", "threads")}
    return {"wall_ms": round(wall * 1e3, 2), "gpu_busy_ms": round(busy, 2), "top_ops": top_ops(prof, steps, cuda),
            "idle": idle,
            "kinds_ms": {k: round(v, 2) for k, v in by_kind.most_common()},
            "top_kernels_ms": {k: round(v, 2) for k, v in by_kernel.most_common(8)},
            "losses": [round(x, 5) for x in losses]}


def top_ops(prof, steps: int, cuda: bool, count: int = 10) -> list[dict]:
    """The operators that launched the most GPU time (their own kernels; on the CPU, their own CPU time), with their
    input shapes and the innermost frames of Python that called them outside torch: which line of the model a
    kernel belongs to."""
    rows = []
    for avg in prof.key_averages(group_by_input_shape=True, group_by_stack_n=12 if cuda else 0):
        device_ms = (avg.self_device_time_total if cuda else avg.self_cpu_time_total) / 1e3 / steps
        if not avg.key.startswith("aten::") or device_ms < (0.5 if cuda else 0.05):
            continue
        frames = [f for f in (avg.stack or []) if "torch/" not in f and "profiler" not in f][:3]
        rows.append({"op": avg.key, "ms": round(device_ms, 2), "calls": avg.count // steps,
                     "shapes": str(avg.input_shapes)[:160], "where": frames})
    return sorted(rows, key=lambda r: -r["ms"])[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a check that the script runs)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (one micro-batch of the b32 run)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; --tiny: 32)")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--systems", default="hf,peft,engine")
    parser.add_argument("--recompute", default=None, help="the engine's `recompute` setting (default: its own)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.seq = args.seq or (32 if args.tiny else 4096)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")
    os.environ.setdefault("ROUNDPIPE_SUMMARY", "0")
    shape, device = (TINY, "cpu") if args.tiny else (FULL, "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batch = make_batch(shape["vocab_size"], args.batch, args.seq)
    on_device = {k: v.to(device) for k, v in batch.items()}
    tokens = args.batch * args.seq
    systems = args.systems.split(",")
    base = {"bench": "moe-layer-profile", "batch": args.batch, "seq": args.seq, "layers": shape["num_hidden_layers"],
            "commit": os.environ.get("BENCH_COMMIT", "unknown")}

    def report(system: str, result: dict) -> None:
        result = {**base, "system": system, "tokens_per_s": round(tokens / result["wall_ms"] * 1e3, 1), **result}
        emit(result, args.out)

    model = build_model(shape, args.seq, device, dtype)
    if "hf" in systems:
        def hf_step():
            loss = model(**on_device).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()
        report("hf full (grouped_mm)", profile_steps(hf_step, args.warm, args.steps, device))
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM")).to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if "peft" in systems:
        optimizer = torch.optim.AdamW(trainable, lr=0.0, fused=device.startswith("cuda"))

        def peft_step():
            loss = model(**on_device).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        report("peft LoRA in GPU memory (merged experts weight)", profile_steps(peft_step, args.warm, args.steps,
                                                                                 device))
        del optimizer
    if "engine" in systems:
        from accelerate_roundpipe import RoundPipeConfig, wrap_model

        model = model.to("cpu")
        settings = {} if args.recompute is None else {"recompute": args.recompute}
        engine = wrap_model(model, RoundPipeConfig(devices=[device if device == "cpu" else "cuda:0"],
                                                   async_optimizer=False, **settings))
        try:
            optimizer = engine.wrap_optimizer(torch.optim.AdamW(
                [p for p in engine.parameters() if p.requires_grad], lr=0.0, fused=device.startswith("cuda")))

            def engine_step():
                loss = engine.forward_backward(**batch)
                optimizer.step()
                optimizer.zero_grad()
                engine.synchronize()
                return loss
            report("engine LoRA (factored experts)", profile_steps(engine_step, args.warm, args.steps, device))
        finally:
            engine.close()


if __name__ == "__main__":
    main()
