"""Host bytes per trainable parameter, by what holds them, for each way of training a small model (issue 33 item 2).

Builds a small Qwen3 (or Llama) from a config in bfloat16 (as users load one: the compute copies keep the model's
dtype, the optimizer copies and gradients are float32), puts it on the engine on CPU workers (and, with a GPU, on
`cuda:0` with the optimizer state on the host and with `optimizer_placement="auto"`), wraps AdamW, runs a few steps
and counts every host buffer the engine holds (`benchmarks/host_buffers.py`: each storage once, by what holds it,
and how much of it is page-locked). Configurations:
- `exact`: the default, exact step, one `forward_backward` per step, no clipping;
- `exact+clip`: with `clip_grad_norm_(1.0)` (the Trainer's default `max_grad_norm`);
- `exact+accumulation`: two `forward_backward` calls before one step (the Trainer with gradient_accumulation_steps
  2: its `grad_scale`);
- `deferred+accumulation`: two calls of a stock Accelerate loop (`loss.backward()` on a deferred pass's loss);
- `lagged`: `async_optimizer=True`; its count after a look (`synchronize()`) adds the stash;
- `lora`: PEFT LoRA r8 on the attention projections (frozen bytes per frozen parameter);
- `exact+disk`: the default with `host_memory_budget` near 0: the optimizer copies and states in swap files,
  but those of a bucket whose staging slots would cost more than they save ([Note: staging slots sized by the plan]).
Each record also has the process's resident memory growth (from before the model was built to after the steps,
with freed memory given back to the OS first) beside the counted sum, as a check that nothing large is missed, and
on a GPU what torch's caching allocator of page-locked host memory holds (activation downloads), outside the sum.
The count is taken after `zero_grad()`, when the buckets hold no gradient buffer ([Note: no spare gradient buffer]):
`grad peak` is the most bytes of gradient buffers alive at once during the run (all of them are the pool's).

    python3 benchmarks/host_bytes.py [--tiny] [--model qwen3|llama] [--hidden 512] [--layers 8] [--out f.jsonl]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.commit import git_commit  # noqa: E402
from benchmarks.host_buffers import (  # noqa: E402
    KINDS,
    TRAINABLE_KINDS,
    count_host_buffers,
    dtypes_of,
    parameter_counts,
    torch_pinned_cache,
)
from benchmarks.records import emit  # noqa: E402

# name -> (engine settings, clip, forward_backward calls per step, deferred passes, LoRA)
CONFIGS = {
    "exact": ({}, None, 1, False, False),
    "exact+clip": ({}, 1.0, 1, False, False),
    "exact+accumulation": ({}, None, 2, False, False),
    "deferred+accumulation": ({}, None, 2, True, False),
    "lagged": ({"async_optimizer": True}, None, 1, False, False),
    "lora": ({}, None, 1, False, True),
    # the trainable buckets' optimizer copies and states past the budget, in swap files (issue 33's disk tier)
    "exact+disk": ({"host_memory_budget": 1e-6}, None, 1, False, False),
}
TINY = dict(hidden=64, layers=2, vocab=256, seq=16, steps=2)
FULL = dict(hidden=512, layers=8, vocab=4096, seq=64, steps=3)
ROWS = 4


def small_model(kind: str, shape: dict, lora: bool = False):
    """A seeded bfloat16 causal LM from a config (nothing downloaded); with `lora`, PEFT's LoRA r8 on the attention
    projections (PEFT keeps the adapters in float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    hidden = shape["hidden"]
    common = dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=shape["layers"],
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=shape["vocab"], max_position_embeddings=512,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def resident_bytes() -> int:
    """This process's resident memory now, after handing freed heap memory back to the OS (glibc's malloc_trim),
    so that a difference of two readings is what is still held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle(engine) -> None:
    """Wait for the passes, deferred commits and steps in flight without looking (a look, `synchronize()`, would
    make a lagged bucket's stash): the gradient buffers are then all in their buckets or the pool."""
    engine._dispatch.wait_inflight()
    engine._deferred.wait_idle()
    engine.optimizer.thread.wait_idle()


def train(engine, optimizer, name: str, shape: dict) -> list[float]:
    _, clip, calls, deferred, _ = CONFIGS[name]
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(shape["steps"]):
        for _ in range(calls):
            ids = torch.randint(4, shape["vocab"], (ROWS, shape["seq"]), generator=generator)
            if deferred:  # a stock loop: the loss's backward commits the pass's gradients, scaled by 1 / calls
                engine.expect_grad_scale(1.0 / calls)
                loss = engine.forward_backward(input_ids=ids, labels=ids, deferred=True)
                (loss / calls).backward()
            else:  # the Trainer: the scale given to the pass
                loss = engine.forward_backward(input_ids=ids, labels=ids, grad_scale=1.0 / calls)
            losses.append(float(loss.detach()))
        if clip is not None:
            optimizer.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def run_one(name: str, devices: list[str], placement: str, args, shape: dict) -> dict:
    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    settings, *_, lora = CONFIGS[name]
    before = resident_bytes()
    model = small_model(args.model, shape, lora)
    config = RoundPipeConfig(devices=devices, num_microbatches=2, summary=False, optimizer_placement=placement,
                             **settings)
    start = time.perf_counter()
    engine = wrap_model(model, config)
    try:
        trainable = [p for p in engine.parameters() if p.requires_grad]
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(trainable, lr=1e-4))
        losses = train(engine, optimizer, name, shape)
        settle(engine)
        held = count_host_buffers(engine)
        grown = resident_bytes() - before
        engine.synchronize()  # a look: what it adds (a lagged bucket's stash) is counted apart
        looked = count_host_buffers(engine)
        counts = parameter_counts(engine)
        dtypes, cache = dtypes_of(engine), torch_pinned_cache()
        grad_peak = engine.host_store.grad_pool.peak_bytes
    finally:
        engine.close()
    del engine, optimizer, trainable, model
    elapsed = time.perf_counter() - start
    trainable_n, frozen_n = counts["trainable_params"], counts["frozen_params"]
    per = {k: held.bytes[k] / trainable_n for k in TRAINABLE_KINDS}
    return {
        "benchmark": "host_bytes", "commit": git_commit(), "config": name, "devices": ",".join(devices),
        "optimizer_placement": placement, "model": args.model, "hidden": shape["hidden"], "layers": shape["layers"],
        "dtypes": dtypes, **counts,
        "bytes": held.bytes, "pinned_bytes": held.pinned, "device_bytes": held.device_bytes,
        "bytes_per_trainable_param": {k: round(v, 4) for k, v in per.items()},
        "host_bytes_per_trainable_param": round(sum(per.values()), 4),
        "pinned_bytes_per_trainable_param": round(sum(held.pinned[k] for k in TRAINABLE_KINDS) / trainable_n, 4),
        "frozen_bytes_per_frozen_param": round(held.bytes["frozen compute"] / frozen_n, 4) if frozen_n else None,
        "counted_bytes": held.total, "rss_growth_bytes": grown,
        # every host gradient buffer is the pool's ([Note: no spare gradient buffer]): the most alive at once
        "grad_buffers_peak_bytes": grad_peak,
        "grad_buffers_peak_bytes_per_trainable_param": round(grad_peak / trainable_n, 4),
        "after_look_bytes": looked.bytes, "stash_bytes_per_trainable_param_after_look":
            round(looked.bytes["stashes"] / trainable_n, 4),
        "torch_pinned_cache": cache, "losses": [round(x, 4) for x in losses], "elapsed_s": round(elapsed, 2)}


SHORT = {"compute": "comp", "frozen compute": "frozen", "optimizer copies": "optim", "gradients": "grad",
         "spare gradients": "spare", "optimizer states": "states", "optimizer scalars": "scal",
         "deferred gradients": "defer", "stashes": "stash", "disk staging": "dstage"}


def cache_mb(cache: dict[str, int]) -> str:
    """What torch's page-locked host cache held (GPU runs: activation downloads), outside the counted sum."""
    return f"{cache['allocated_bytes.current'] / 1e6:.1f}" if "allocated_bytes.current" in cache else "-"


def table(records: list[dict]) -> str:
    """Bytes per trainable parameter by kind (frozen: per frozen parameter), the total, the page-locked share, the
    stash a look adds, and the counted sum against the resident growth."""
    kinds = [k for k in KINDS if k != "frozen compute"]
    head = ["config", "devices", "place", *[SHORT[k] for k in kinds], "total", "grad peak", "pinned", "+look",
            "frozen/f",
            "counted MB", "RSS+ MB", "torch pinned cache MB"]
    rows = [head]
    for r in records:
        per = r["bytes_per_trainable_param"]
        frozen = r["frozen_bytes_per_frozen_param"]
        rows.append([r["config"], r["devices"], r["optimizer_placement"], *[f"{per[k]:.2f}" for k in kinds],
                     f"{r['host_bytes_per_trainable_param']:.2f}",
                     f"{r['grad_buffers_peak_bytes_per_trainable_param']:.2f}",
                     f"{r['pinned_bytes_per_trainable_param']:.2f}",
                     f"{r['stash_bytes_per_trainable_param_after_look']:.2f}",
                     "-" if frozen is None else f"{frozen:.2f}", f"{r['counted_bytes'] / 1e6:.1f}",
                     f"{r['rss_growth_bytes'] / 1e6:.1f}", cache_mb(r["torch_pinned_cache"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model, 2 steps: seconds on CPU")
    parser.add_argument("--model", choices=("qwen3", "llama"), default="qwen3")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--out", default=None, help="append the records to this JSONL file")
    args = parser.parse_args(argv)
    shape = dict(TINY if args.tiny else FULL)
    shape.update({k: v for k, v in (("hidden", args.hidden), ("layers", args.layers), ("steps", args.steps))
                  if v is not None})
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    runs = [(["cpu", "cpu"], "host", names)]
    if torch.cuda.is_available() and not args.tiny:
        runs += [(["cuda:0"], "host", names), (["cuda:0"], "auto", names)]
    records = []
    for devices, placement, chosen in runs:
        # Untimed tiny runs first: imports and first uses (PEFT's, a GPU's context) would otherwise count as growth.
        for name in {chosen[0], *(n for n in chosen if CONFIGS[n][4])}:
            run_one(name, devices, placement, args, dict(TINY, steps=1))
        for name in chosen:
            record = run_one(name, devices, placement, args, shape)
            emit(record, args.out, label="host-bytes")
            records.append(record)
    print(table(records), flush=True)
    return records


if __name__ == "__main__":
    main()
