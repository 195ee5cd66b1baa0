"""Our engine three ways over the same batch: the engine API, a stock Accelerate loop, and `RoundPipeTrainer`.

Each `run_*` takes a model built by the caller (it is put on RoundPipe in place: pass each path its own copy), a
`RoundPipeConfig`, a batch of CPU tensors (`input_ids`, `attention_mask`, `labels`, rows x seq), the warm-up and
timed step counts and the learning rate, and returns

    {"iter_s": seconds per steady-state step (the engine synchronized before the first timed step and after the last,
               so the lagged optimizer step of the last step is inside the clock), "tokens_per_s": rows*seq / iter_s,
     "losses": the loss of every step (floats), "step_s": unsynchronized wall time of each step (informational),
     "num_microbatches": micro-batches per step, "gpu_peak_gib", "host_peak_gib", "path": the path's settings}

What is held equal so that the three tokens/s compare (the Trainer's choices, copied into the two loops):
- the same rows every step, one `forward_backward` per step over all of them (no gradient accumulation), the
  micro-batch count of `config` (the Trainer gets it as `roundpipe_*` training arguments, the Accelerate loop as a
  `RoundPipePlugin`, the engine directly);
- torch's fused CPU AdamW, betas (0.9, 0.999), eps 1e-8, weight decay 0, a constant learning rate (what
  `optim="adamw_torch_fused"` with the Trainer's defaults and `lr_scheduler_type="constant"` builds), stepped lagged
  by the engine; no gradient clipping (`max_grad_norm=0`; the Trainer then measures the norm it logs on the optimizer
  thread, one step late, which is part of its path);
- the loss read on the host every step (`loss.item()`): the Trainer does that itself (its NaN filter and
  `logging_steps=1` in the tests; the command line uses `logging_steps=10`, as a user logging often would), so the two
  loops do it too;
- compute dtype: the model's own. A bfloat16 model gets `mixed_precision="bf16"` / `bf16=True` on the integration
  paths, which means bfloat16 compute copies with float32 optimizer copies there, as the engine does for it.

`main()` (the command line) builds a random-init model of one of the benchmark workloads per run and appends records
in the results format of `benchmarks/collect.py`; run one system per process (the host peak is per process):

    python benchmarks/paths.py --workload qwen3-1.7b-full-s4096-b8 --system roundpipe-trainer --nms 4 --out ours.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipeConfig, wrap_model  # noqa: E402
from benchmarks.collect import git_commit  # noqa: E402

ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # TrainingArguments' defaults


# ---------------------------------------------------------------------------------------------- measuring


def _cuda_indices(config: RoundPipeConfig) -> list[int]:
    return sorted({d.index or 0 for d in config.resolved_devices() if d.type == "cuda"})


def _read_host_peak_gib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


class _Meter:
    """GPU peak (max allocated over the config's CUDA devices) and host peak RSS (VmHWM) from now on."""

    def __init__(self, config: RoundPipeConfig) -> None:
        self.cuda = _cuda_indices(config)
        for i in self.cuda:
            torch.cuda.reset_peak_memory_stats(i)
        try:  # Linux: "5" resets the peak RSS to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def read(self) -> dict:
        gpu = max((torch.cuda.max_memory_allocated(i) / 2**30 for i in self.cuda), default=None)
        return {"gpu_peak_gib": None if gpu is None else round(gpu, 2), "host_peak_gib": _read_host_peak_gib()}


class _Clock:
    """Steps 0..warm-1 warm up; the clock runs from a synchronized start of step `warm` to a synchronized end of the
    last step."""

    def __init__(self, warm: int, iters: int, synchronize) -> None:
        self.warm, self.iters, self.synchronize = warm, iters, synchronize
        self.start = self.stop = None
        self.step_s: list[float] = []
        self._tick = 0.0

    def begin(self, step: int) -> None:
        if step == self.warm:
            self.synchronize()
            self.start = time.perf_counter()
        self._tick = time.perf_counter()

    def end(self, step: int) -> None:
        self.step_s.append(round(time.perf_counter() - self._tick, 4))
        if step == self.warm + self.iters - 1:
            self.synchronize()
            self.stop = time.perf_counter()

    def iter_s(self) -> float:
        if self.start is None or self.stop is None:
            raise RuntimeError(f"the timed steps did not all run (ran {len(self.step_s)} of "
                               f"{self.warm + self.iters} steps)")
        return (self.stop - self.start) / self.iters


def _synchronizer(get_engine, config: RoundPipeConfig):
    cuda = _cuda_indices(config)

    def synchronize() -> None:
        get_engine().synchronize()
        for i in cuda:
            torch.cuda.synchronize(i)

    return synchronize


def _check(batch: dict, warm: int, iters: int) -> tuple[int, int]:
    if iters < 1 or warm < 0:
        raise ValueError(f"need iters >= 1 and warm >= 0, got warm={warm} iters={iters}")
    rows, seq = batch["input_ids"].shape
    return rows, seq


def _result(clock: _Clock, losses: list[float], rows: int, seq: int, microbatches: int, meter: _Meter,
            path: dict) -> dict:
    iter_s = clock.iter_s()
    return {"iter_s": round(iter_s, 6), "tokens_per_s": round(rows * seq / iter_s, 1), "losses": losses,
            "step_s": clock.step_s, "num_microbatches": microbatches, **meter.read(), "path": path}


def _adamw(params, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, fused=True, **ADAMW)


def _describe(optimizer: torch.optim.Optimizer) -> str:
    """What steps the optimizer copies, e.g. 'AdamW(lr=1e-05, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0,
    fused=True) x 2 groups'."""
    group = optimizer.param_groups[0]
    keys = ("lr", "betas", "eps", "weight_decay", "fused")
    text = ", ".join(f"{k}={group.get(k)}" for k in keys)
    return f"{type(optimizer).__name__}({text}) x {len(optimizer.param_groups)} groups"


def _close(engine) -> None:
    if engine is not None:
        try:
            engine.close()
        except Exception as error:  # noqa: BLE001 -- a failed run's engine may not close cleanly; keep its error
            print(f"[paths] engine.close() failed: {error!r}", file=sys.stderr, flush=True)


def _is_bf16(model: torch.nn.Module) -> bool:
    return any(p.dtype == torch.bfloat16 for p in model.parameters())


def _reset_accelerate_state() -> None:
    """Each path starts like a fresh process (accelerate keeps process-wide singletons)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# ---------------------------------------------------------------------------------------------- the three paths


def run_engine(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
               lr: float = 1e-5) -> dict:
    """`wrap_model` + `engine.wrap_optimizer(AdamW)`, then forward_backward / step / zero_grad."""
    rows, seq = _check(batch, warm, iters)
    meter = _Meter(config)
    engine = None
    try:
        engine = wrap_model(model, config)
        optimizer = engine.wrap_optimizer(_adamw([p for p in engine.parameters() if p.requires_grad], lr))
        clock = _Clock(warm, iters, _synchronizer(lambda: engine, config))
        losses = []
        for step in range(warm + iters):
            clock.begin(step)
            loss = engine.forward_backward(**batch)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            clock.end(step)
        return _result(clock, losses, rows, seq, engine.num_microbatches_for(rows), meter,
                       {"api": "wrap_model + forward_backward", "optimizer": _describe(optimizer.inner)})
    finally:
        _close(engine)


def run_accelerate_loop(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
                        lr: float = 1e-5) -> dict:
    """The loop of docs/ways-in.md, way 1: `RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(...))`, prepare,
    then `loss = model(**batch).loss; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()`."""
    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
    from accelerate_roundpipe.integrations.convert import engine_of

    rows, seq = _check(batch, warm, iters)
    _reset_accelerate_state()
    meter = _Meter(config)
    plugin = RoundPipePlugin(**{f.name: getattr(config, f.name) for f in dataclasses.fields(RoundPipeConfig)})
    precision = "bf16" if _is_bf16(model) else "no"
    accelerator = RoundPipeAccelerator(roundpipe_plugin=plugin, mixed_precision=precision)
    engine = None
    try:
        optimizer = _adamw([p for p in model.parameters() if p.requires_grad], lr)
        model, optimizer = accelerator.prepare(model, optimizer)
        engine = engine_of(model)
        model.train()
        clock = _Clock(warm, iters, _synchronizer(lambda: engine, config))
        losses = []
        for step in range(warm + iters):
            clock.begin(step)
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            clock.end(step)
        return _result(clock, losses, rows, seq, engine.num_microbatches_for(rows), meter,
                       {"api": "RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(...)) stock loop",
                        "mixed_precision": precision, "optimizer": _describe(optimizer.optimizer.inner)})
    finally:
        _close(engine)
        _reset_accelerate_state()


class _RowsDataset(torch.utils.data.Dataset):
    """The batch's rows repeated: with sequential sampling, every Trainer step gets exactly `batch`."""

    def __init__(self, batch: dict, steps: int) -> None:
        self.batch, self.rows = batch, batch["input_ids"].shape[0]
        self.length = self.rows * steps

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {k: v[index % self.rows] for k, v in self.batch.items()}


def _training_args_value(value: Any) -> Any:
    """A RoundPipeConfig value as a `--roundpipe_*` argument takes it (lists comma-separated, dtypes by name)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def run_trainer(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
                lr: float = 1e-5, logging_steps: int = 1) -> dict:
    """`RoundPipeTrainer` + `RoundPipeTrainingArguments` (per_device_train_batch_size = rows, max_steps = warm +
    iters, the batch's rows repeated, sequential sampling, `logging_steps`, no evaluation or saving), timed by a
    callback (on_step_begin of the first timed step to on_step_end of the last)."""
    from transformers import TrainerCallback, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    rows, seq = _check(batch, warm, iters)
    _reset_accelerate_state()
    meter = _Meter(config)
    trainer = None
    clock = _Clock(warm, iters, _synchronizer(lambda: trainer.roundpipe_engine, config))
    losses: list[float] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            clock.end(state.global_step - 1)  # global_step already counts this step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    roundpipe = {"roundpipe_" + f.name: _training_args_value(getattr(config, f.name))
                 for f in dataclasses.fields(RoundPipeConfig) if getattr(config, f.name) is not None}
    sequential = {}
    trainer_cls = RoundPipeTrainer
    if any(f.name == "train_sampling_strategy" for f in dataclasses.fields(TrainingArguments)):
        sequential["train_sampling_strategy"] = "sequential"
    else:  # older transformers: no such argument; same effect, nothing else changed
        class SequentialTrainer(RoundPipeTrainer):
            def _get_train_sampler(self, *args, **kwargs):
                return torch.utils.data.SequentialSampler(self.train_dataset)

        trainer_cls = SequentialTrainer
    bf16 = _is_bf16(model)
    with tempfile.TemporaryDirectory(prefix="roundpipe-bench-trainer-") as output_dir:
        args = RoundPipeTrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
            max_steps=warm + iters, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch_fused", weight_decay=ADAMW["weight_decay"], adam_beta1=ADAMW["betas"][0],
            adam_beta2=ADAMW["betas"][1], adam_epsilon=ADAMW["eps"], max_grad_norm=0.0, bf16=bf16,
            logging_steps=logging_steps, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, dataloader_pin_memory=torch.cuda.is_available(),
            use_cpu=not torch.cuda.is_available(), **sequential, **roundpipe)
        try:
            trainer = trainer_cls(model=model, args=args, train_dataset=_RowsDataset(batch, warm + iters),
                                  callbacks=[Timing()])
            trainer.train()
            engine = trainer.roundpipe_engine
            return _result(clock, losses, rows, seq, engine.num_microbatches_for(rows), meter,
                           {"api": "RoundPipeTrainer + RoundPipeTrainingArguments", "bf16": bf16,
                            "optimizer": _describe(trainer.optimizer.optimizer.inner),
                            "max_grad_norm": 0.0, "lr_scheduler_type": "constant",
                            "logging_steps": logging_steps})
        finally:
            _close(trainer.roundpipe_engine if trainer is not None else None)
            _reset_accelerate_state()


PATHS = {"roundpipe-engine": run_engine, "roundpipe-accelerate-loop": run_accelerate_loop,
         "roundpipe-trainer": run_trainer}


# ---------------------------------------------------------------------------------------------- command line

# Published architecture numbers (the models' config.json files), as in the anchors' common.py.
ARCHITECTURES = {
    "qwen3-1.7b": ("Qwen3Config", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen3-4b": ("Qwen3Config", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "llama3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    # CPU smoke runs only
    "tiny-llama": ("LlamaConfig", dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, tie_word_embeddings=False, max_position_embeddings=4096)),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

WORKLOADS = {
    "qwen3-1.7b-full-s4096-b8": dict(arch="qwen3-1.7b", lora=False, seqs=[4096], gb=8, cap=0.0),
    "qwen3-4b-full-s4096-b8-cap24": dict(arch="qwen3-4b", lora=False, seqs=[4096], gb=8, cap=24.0),
    "llama3.1-8b-lora-s4096-b8": dict(arch="llama3.1-8b", lora=True, seqs=[4096], gb=8, cap=0.0),
    # the sequence-length sweep under a 24 GiB cap, batch 1: stops at the first failure
    "qwen3-1.7b-cap24-b1": dict(arch="qwen3-1.7b", lora=False, seqs=[4096, 8192, 16384, 32768, 65536, 131072],
                                gb=1, cap=24.0),
    # CPU smoke runs of the command line
    "tiny-llama-full-s16-b4": dict(arch="tiny-llama", lora=False, seqs=[16], gb=4, cap=0.0),
    "tiny-llama-cap1-b1": dict(arch="tiny-llama", lora=False, seqs=[16, 32], gb=1, cap=1.0),
}
SWEEP_WORKLOADS = {name for name, w in WORKLOADS.items() if len(w["seqs"]) > 1}


def flops_per_token(model_config, seq: int, lora: bool) -> float:
    """The anchors' count (common.train_flops_per_token), so MFUs compare: full FT with recompute 8 x params, LoRA
    6 x matmul params, plus causal attention counted at half, times 4 (forward, recompute, 2x backward)."""
    c = model_config
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    qd, kvd = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = h * qd + 2 * h * kvd + qd * h + 3 * h * inter + 2 * h + 2 * hd
    emb = c.vocab_size * h
    total = layers * per_layer + emb + h + (0 if c.tie_word_embeddings else emb)
    matmul = layers * (h * qd + 2 * h * kvd + qd * h + 3 * h * inter) + emb
    attn = 4 * (2 * 2 * seq * qd * 0.5) * layers
    return (6 * matmul if lora else 8 * total) + attn


def build_model(arch: str, seq: int, lora: bool, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Random init (N(0, 0.02) matrices, norms 1) on the GPU when there is one (fast), then moved to the CPU."""
    import transformers

    config_cls, kwargs = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls)(**kwargs)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    build_on = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(build_on):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                                 task_type="CAUSAL_LM"))
        model = model.to(dtype)  # adapters in the model dtype too: all three paths then compute the same
    model = model.to("cpu")
    if build_on == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    model.train()
    return model


def memory_cap(cap_gib: float) -> None:
    """Emulate a smaller card, as the anchors' common.mem_cap does (allocator fraction + capped mem_get_info)."""
    if not cap_gib or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, 0)
    original = torch.cuda.mem_get_info

    def capped(device=None):
        free, _ = original(device)
        cap = int(cap_gib * 2**30)
        return max(0, min(free, cap - torch.cuda.memory_reserved(0))), cap

    torch.cuda.mem_get_info = capped


def is_oom(error: BaseException) -> bool:
    seen = error
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, torch.cuda.OutOfMemoryError) or "out of memory" in text or "cuda_error_out_of_memory" in \
                text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def make_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict:
    ids = torch.randint(0, vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_one(workload: str, system: str, seq: int, config: RoundPipeConfig, warm: int, iters: int, lr: float,
            peak_tflops: float, trainer_logging_steps: int = 10) -> dict:
    w = WORKLOADS[workload]
    record = {"workload": workload, "system": system, "seq": seq, "global_batch": w["gb"],
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "commit": git_commit(),
              "max_seq": seq if workload in SWEEP_WORKLOADS else None}
    settings = {"seq": seq, "global_batch": w["gb"], "mem_cap_gib": w["cap"], "lora": w["lora"],
                "num_microbatches": config.num_microbatches, "warm": warm, "iters": iters, "lr": lr,
                "tokens_per_s_basis": "mean of the timed steps, synchronized at both ends",
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "config": {f.name: _training_args_value(getattr(config, f.name))
                           for f in dataclasses.fields(RoundPipeConfig) if getattr(config, f.name) is not None}}
    try:
        import transformers

        settings["transformers"] = transformers.__version__
        model = build_model(w["arch"], seq, w["lora"])
        model_config = getattr(model, "config", None)
        fpt = flops_per_token(model_config, seq, w["lora"])
        batch = make_batch(model_config.vocab_size, w["gb"], seq)
        extra = {"logging_steps": trainer_logging_steps} if system == "roundpipe-trainer" else {}
        result = PATHS[system](model, config, batch, warm, iters, lr, **extra)
    except Exception as error:  # noqa: BLE001 -- a failed configuration is a result too
        status = "OOM" if is_oom(error) else "ERROR"
        print(f"[paths] {workload} {system} seq={seq}: {status} {error!r}", file=sys.stderr, flush=True)
        return {**record, "tokens_per_s": None, "mfu": None, "gpu_peak_gib": None, "host_peak_gib": None,
                "status": status, "error": repr(error)[:600], "settings": settings}
    settings.update(num_microbatches=result["num_microbatches"], path=result["path"], step_s=result["step_s"])
    mfu = fpt * result["tokens_per_s"] / (peak_tflops * 1e12) if peak_tflops else None
    median_step = statistics.median(result["step_s"][warm:])
    return {**record, "tokens_per_s": result["tokens_per_s"], "iter_s": result["iter_s"],
            # Steady state as the reference's and the in-GPU anchors' scripts report it: the median timed step.
            "tokens_per_s_median_step": round(w["gb"] * seq / median_step, 1),
            "mfu": None if mfu is None else round(mfu, 3), "gpu_peak_gib": result["gpu_peak_gib"],
            "host_peak_gib": result["host_peak_gib"], "status": "ok", "losses": [round(v, 5) for v in
                                                                               result["losses"]],
            "flops_per_token": fpt, "settings": settings}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--system", required=True, choices=sorted(PATHS))
    parser.add_argument("--nms", default="4", help="micro-batch counts to run (comma-separated; 'auto': the "
                        "engine's choice), one record each")
    parser.add_argument("--seqs", default=None, help="override the workload's sequence lengths (comma-separated)")
    parser.add_argument("--devices", default=None, help="RoundPipe devices (default: cuda:0, else cpu)")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak for the MFU")
    parser.add_argument("--kernels", default=None, choices=["auto", "liger", "none"])
    parser.add_argument("--trace-dir", default=None, help="write a timeline trace per run here (then "
                        "`python -m accelerate_roundpipe.telemetry.report TRACE` gives the measured bubble)")
    parser.add_argument("--budget", type=float, default=None, help="gpu_memory_budget in GiB (default: the cap)")
    parser.add_argument("--mlp-chunk-tokens", type=int, default=None, help="tile dense MLPs above this many tokens")
    parser.add_argument("--recompute", default=None, choices=["stage", "layer"])
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--out", required=True, help="JSONL file the records are appended to")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    w = WORKLOADS[args.workload]
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else w["seqs"]
    devices = args.devices.split(",") if args.devices else (["cuda:0"] if torch.cuda.is_available() else ["cpu"])
    memory_cap(w["cap"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for nms in (None if v == "auto" else int(v) for v in args.nms.split(",")):
        for seq in seqs:
            extra = {"gpu_memory_budget": w["cap"]} if w["cap"] and any(d.startswith("cuda") for d in devices) else {}
            if args.budget:
                extra["gpu_memory_budget"] = args.budget
            if args.mlp_chunk_tokens:
                extra["mlp_chunk_tokens"] = args.mlp_chunk_tokens
            if args.trace_dir:
                extra["trace_path"] = str(Path(args.trace_dir) / f"{args.workload}-{args.system}-s{seq}-n{nms}.json")
            config = RoundPipeConfig(devices=devices, num_microbatches=nms and min(nms, w["gb"]), kernels=args.kernels,
                                     recompute=args.recompute, **extra)
            record = run_one(args.workload, args.system, seq, config, args.warm, args.iters, args.lr,
                             args.peak_tflops if torch.cuda.is_available() else 0.0)
            line = json.dumps(record)
            print("RESULT", line, flush=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if record["status"] != "ok" and args.workload in SWEEP_WORKLOADS:
                break  # sequence sweep: stop at the first failure


if __name__ == "__main__":
    main()
