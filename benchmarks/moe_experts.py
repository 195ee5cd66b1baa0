"""Which experts implementation a mixture-of-experts model trains fastest with, in one process.

A Qwen3-MoE model with Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts, top-8, expert width 768, 32 query
and 4 key/value heads of 128) but 4 decoder layers and a 32,000-token vocabulary, in bfloat16, random weights:

- `hf`: plain Hugging Face forward + backward of every parameter in GPU memory, with transformers' default
  experts implementation (grouped_mm) and each other one (eager, batched_mm); with `--liger` also Liger-Kernel's
  fused experts forward (`LigerExperts`, what `kernels='auto'` put on full fine-tuning; its Triton autotuning takes
  minutes in a fresh process, so it is asked for; it runs last, beside grouped_mm again, as `hf-liger-pair`:
  by then the engine has applied Liger's RoPE to the family, process-wide);
- `peft-in-gpu`: plain PEFT, LoRA r16 on q, k, v, o, gate, up, down (which reach the experts), in GPU memory, with
  the default implementation: the in-GPU reference of the next part;
- `engine`: the same LoRA model on RoundPipe (`wrap_model`, devices ["cuda:0"], the exact step, fused AdamW),
  each implementation in turn on one engine, chosen as a user would (`model.set_experts_implementation`), with the
  experts' LoRA computed through its factors ([Note: factored LoRA on experts]); `engine-peft-merged`: the same
  engine with grouped_mm and PEFT's own computation (the merged weight per call), beside it.

Every variant sees the same weights and batch (the learning rate is 0 unless `--lr` says otherwise), so the losses
compare across implementations (bf16 rounding only). One `RESULT {...}` line per variant: tokens/s, seconds per
step, GPU peak, losses, and `ran`: how many experts calls ran each implementation (counted at transformers'
dispatch; Liger's forward bypasses it, so its variant counts none). A variant that runs out of memory (batched_mm
gathers every token's expert weights: 2 x 4096 x 8 x 1536 x 2048 bf16 values, 384 GiB, for the first projection)
is a record with its error. Variants that would start past `--budget-s` are skipped (a record says so). `--tiny`
runs everything small on CPU workers in float32 (a check that the script runs).

    python3 benchmarks/moe_experts.py [--tiny] [--seq 4096] [--batch 2] [--warm 2] [--iters 3] [--liger]
        [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.memory import is_oom  # noqa: E402
from benchmarks.models import init_weights, make_batch  # noqa: E402
from benchmarks.records import emit  # noqa: E402

# Qwen3-30B-A3B's layer shapes, 4 layers, a 32K vocabulary.
FULL = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_hidden_layers=4, vocab_size=32000)
TINY = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=256)
IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")  # transformers' default first
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Dispatches:
    """Counts the experts implementation each experts call runs, at transformers' dispatch
    (`ALL_EXPERTS_FUNCTIONS.get_interface`, which every `@use_experts_implementation` forward calls)."""

    def __init__(self) -> None:
        from transformers.integrations import moe

        self.counts: collections.Counter = collections.Counter()
        self.interface = moe.ALL_EXPERTS_FUNCTIONS
        original = type(self.interface).get_interface.__get__(self.interface)

        def counted(name, default):
            self.counts[name] += 1
            return original(name, default)

        self.interface.get_interface = counted
        # LoRA on the experts through its factors bypasses that dispatch; counted by the implementation it runs
        from accelerate_roundpipe.compat import peft_experts
        from accelerate_roundpipe.compat.hf_experts import implementation_of

        self.factored = peft_experts.factored_experts_forward

        def counted_factored(experts, *args):
            self.counts[implementation_of(experts)] += 1
            return self.factored(experts, *args)

        peft_experts.factored_experts_forward = counted_factored

    def close(self) -> None:
        from accelerate_roundpipe.compat import peft_experts

        self.interface.__dict__.pop("get_interface", None)
        peft_experts.factored_experts_forward = self.factored

    def take(self) -> dict:
        counts, self.counts = dict(self.counts), collections.Counter()
        return counts


def build_model(shape: dict, seq: int, device: str, dtype: torch.dtype):
    import transformers

    config = transformers.Qwen3MoeConfig(**shape, max_position_embeddings=max(seq, 4096), use_cache=False,
                                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    init_weights(model, torch.Generator(device).manual_seed(0))
    return model.train()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def gpu_peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None


def set_implementation(model, name: str) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_experts_implementation(name)


class LigerExperts:
    """Liger-Kernel's fused experts forward on every experts module of the model, for one variant (Liger's own
    instance patch binds the same forward; its norms and RoPE are left out here, so only the experts differ)."""

    def __init__(self, model) -> None:
        from liger_kernel.transformers.swiglu import LigerExperts as Liger

        self.modules = [layer.mlp.experts for layer in model.model.layers]
        for module in self.modules:
            module.forward = types.MethodType(Liger.forward, module)

    def undo(self) -> None:
        for module in self.modules:
            del module.forward


def timed(step, warm: int, iters: int, device: str) -> tuple[float, list[float]]:
    """Seconds per timed step (after `warm` steps) and every step's loss."""
    losses = []
    for index in range(warm + iters):
        if index == warm:
            synchronize(device)
            start = time.perf_counter()
        losses.append(float(step()))
    synchronize(device)
    return (time.perf_counter() - start) / iters, losses


class Bench:
    def __init__(self, args, shape: dict, device: str, dtype: torch.dtype) -> None:
        self.args, self.shape, self.device, self.dtype = args, shape, device, dtype
        self.deadline = time.perf_counter() + args.budget_s
        self.batch = make_batch(shape["vocab_size"], args.batch, args.seq)
        self.tokens = args.batch * args.seq
        self.dispatches = Dispatches()

    def record(self, part: str, implementation: str, measure) -> None:
        """Run one variant (`measure()` -> (seconds per step, losses)) and emit its record."""
        base = {"bench": "moe-experts", "part": part, "experts_implementation": implementation,
                "default": implementation == "grouped_mm"}
        # after the numbers: bench.sh shows each result line's first 400 characters
        tail = {"device": self.device, "dtype": str(self.dtype), "seq": self.args.seq, "batch": self.args.batch,
                "shape": self.shape, "commit": os.environ.get("BENCH_COMMIT", "unknown")}
        left = self.deadline - time.perf_counter()
        if left < self.args.min_left_s:
            emit({**base, "skipped": f"{left:.0f} s of the {self.args.budget_s:.0f} s budget left", **tail},
                 self.args.out)
            return
        reset_peak(self.device)
        self.dispatches.take()
        started = time.perf_counter()
        try:
            iter_s, losses = measure()
        except Exception as error:  # noqa: BLE001 -- an implementation that fails (OOM) is a result
            if not is_oom(error) and not self.args.keep_going:
                raise
            emit({**base, "error": f"{type(error).__name__}: {str(error)[:300]}", "oom": is_oom(error),
                  "gpu_peak_gib": gpu_peak_gib(self.device), "ran": self.dispatches.take(),
                  "wall_s": round(time.perf_counter() - started, 1), **tail}, self.args.out)
            reset_peak(self.device)
            return
        emit({**base, "tokens_per_s": round(self.tokens / iter_s, 1), "iter_s": round(iter_s, 4),
              "gpu_peak_gib": gpu_peak_gib(self.device), "losses": [round(x, 5) for x in losses],
              "ran": self.dispatches.take(), "wall_s": round(time.perf_counter() - started, 1), **tail},
             self.args.out)

    def hf(self, model, implementations: tuple[str, ...], part: str = "hf") -> None:
        """Plain HF forward + backward of every parameter, in GPU memory."""
        batch = {k: v.to(self.device) for k, v in self.batch.items()}

        def step():
            loss = model(**batch).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        for name in implementations:
            if name == "liger":
                set_implementation(model, "grouped_mm")  # not read: Liger's forward replaces the dispatch
                patch = LigerExperts(model)
                try:
                    self.record(part, "liger", lambda: timed(step, self.args.warm, self.args.iters, self.device))
                finally:
                    patch.undo()
                continue
            set_implementation(model, name)
            self.record(part, name, lambda: timed(step, self.args.warm, self.args.iters, self.device))
        set_implementation(model, "grouped_mm")
        model.zero_grad(set_to_none=True)

    def peft_in_gpu(self, model) -> None:
        """Plain PEFT LoRA with AdamW, in GPU memory, default implementation."""
        batch = {k: v.to(self.device) for k, v in self.batch.items()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.args.lr, fused=True)

        def step():
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        self.record("peft-in-gpu", "grouped_mm", lambda: timed(step, self.args.warm, self.args.iters, self.device))

    def engine(self, model, implementations: tuple[str, ...]) -> None:
        """RoundPipe over the LoRA model (on the host), the exact step, fused AdamW; one engine, each
        implementation chosen on the model in turn (the engine's layer copies follow it)."""
        from accelerate_roundpipe import RoundPipeConfig, wrap_model

        devices = ["cuda:0"] if self.device.startswith("cuda") else ["cpu"]
        engine = wrap_model(model, RoundPipeConfig(devices=devices, async_optimizer=False))
        try:
            trainable = [p for p in engine.parameters() if p.requires_grad]
            optimizer = engine.wrap_optimizer(torch.optim.AdamW(trainable, lr=self.args.lr, fused=True))

            def step():
                loss = engine.forward_backward(**self.batch)
                optimizer.step()
                optimizer.zero_grad()
                return loss

            def measure():
                iter_s, losses = timed(step, self.args.warm, self.args.iters, "cpu")
                engine.synchronize()
                return iter_s, losses

            from accelerate_roundpipe.compat import peft_experts

            for name in implementations:
                set_implementation(model, name)
                if name == "grouped_mm":  # PEFT's own first (the whole merged weight per call), then ours again:
                    # the engine's first variant also pays its measured pass and re-plan
                    self.record("engine", name, measure)
                    peft_experts.enabled = False
                    try:
                        self.record("engine-peft-merged", name, measure)
                    finally:
                        peft_experts.enabled = True
                self.record("engine", name, measure)  # the factored LoRA on the experts where it applies
        finally:
            try:
                engine.close()
            except Exception as error:  # noqa: BLE001 -- an engine a failed variant left may not close cleanly
                print(f"[bench] engine.close() failed: {error!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU workers, float32")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; --tiny: 32)")
    parser.add_argument("--batch", type=int, default=2, help="rows per step")
    parser.add_argument("--warm", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--lr", type=float, default=0.0, help="AdamW learning rate (0: every variant, same weights)")
    parser.add_argument("--liger", action="store_true", help="also Liger-Kernel's fused experts in plain HF")
    parser.add_argument("--budget-s", type=float, default=140.0, help="no variant starts after this many seconds")
    parser.add_argument("--min-left-s", type=float, default=12.0, help="a variant needs this much budget left")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                        help="the experts implementations the hf and engine parts run, comma-separated")
    parser.add_argument("--keep-going", action="store_true", help="record any variant's error, not only OOM")
    parser.add_argument("--out", default=None, help="append the records to this JSON-lines file")
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 32 if args.tiny else 4096
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny, on CPU)")
    if args.liger and (args.tiny or not torch.cuda.is_available()):
        parser.error("--liger needs a CUDA GPU (Liger's experts are Triton kernels); leave out --tiny")
    os.environ.setdefault("ROUNDPIPE_SUMMARY", "0")
    shape, device = (TINY, "cpu") if args.tiny else (FULL, "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    bench = Bench(args, shape, device, dtype)
    try:
        run(bench, args, shape, device, dtype)
    finally:
        bench.dispatches.close()


def run(bench: Bench, args, shape: dict, device: str, dtype: torch.dtype) -> None:
    from peft import LoraConfig, get_peft_model

    model = build_model(shape, args.seq, device, dtype)
    implementations = tuple(args.implementations.split(","))
    bench.hf(model, implementations)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM")).to(dtype)
    bench.peft_in_gpu(model)
    model = model.to("cpu")
    reset_peak(device)
    bench.engine(model, implementations)
    if args.liger:  # last: its autotuning would keep everything else from running in the budget
        del model  # grouped_mm again beside it: the engine applied Liger's RoPE to the family, process-wide
        bench.hf(build_model(shape, args.seq, device, dtype), ("grouped_mm", "liger"), part="hf-liger-pair")


if __name__ == "__main__":
    main()
