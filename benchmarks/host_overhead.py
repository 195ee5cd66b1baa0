"""Host-side (Python) time per training step: RoundPipe beside the plain loop, on the CPU, on a model so small that
its compute is small (issue 31 item 10: on one H200 the 168M preset's step is 77 ms against the plain Trainer's 65).

The 168M Qwen3 preset's shape (12 decoder layers, 2 heads per kv head, an untied head) at hidden 64, vocabulary 256,
8 x 64 tokens per step, with one torch thread. The engine runs as it does on one H200 at its defaults
(`ENGINE_SETTINGS`: the measured plan, i.e. the whole model as the fused stage without recomputation, and the
optimizer state on the device), on one CPU worker. Every system trains the same initial weights with AdamW and
`max_grad_norm=1.0`:

- `loop` (the default): the plain torch loop (forward with labels, backward, `clip_grad_norm_`, step, zero_grad, the
  loss read) beside the engine's (`wrap_model`, `forward_backward`, the optimizer's exact clip, step, zero_grad, the
  loss read, `synchronize` so that the optimizer thread's work is inside the step), twice: as it runs
  (`roundpipe`) and without the CPU worker's RNG dispatch mode (`roundpipe, no CPU RNG`: a CUDA worker has none, so
  that row is the host work a GPU step also does; the model has no dropout, so the numbers are the same). The
  systems take turns, `--block` steps each, so that a busy machine slows them alike; each line gives the median
  step (wall clock) and the median CPU time of every thread of the process during a step, and for the engines
  `prepare` (`wrap_model` + `wrap_optimizer`) and the first step (the measured pass).
- `trainer`: `transformers.Trainer` beside `RoundPipeTrainer` (the CPU worker without its RNG mode),
  `logging_steps=1` as in the convergence preset: the median gap between `on_step_end` callbacks, the CPU time of
  the caller's thread per step (RoundPipe's: the Trainer's and the engine's Python on the caller, with the compute
  on the worker), prepare (from `train()` to the first step's start) and the first step.

    PYTHONPATH=. python3 benchmarks/host_overhead.py [--mode loop|trainer|both] [--steps 120] [--profile STEPS]

`--profile STEPS` then runs STEPS more engine steps under cProfile in every thread (the caller by cumulative time,
each engine thread by own time, and each engine thread's own functions apart); with `--mode trainer`, the caller's
thread of both Trainers past the warm-up. The profiler slows Python several times over: compare functions with each
other, and take times from the runs without it. A shared machine moves every number by 10-20% between runs: compare
systems within one run, and prefer the CPU-time columns.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# What the engine runs on one H200 at its defaults for the 168M preset: the measured plan (the whole model as the
# fused stage, no recomputation) and the optimizer state on the device; a CPU worker takes both when asked.
ENGINE_SETTINGS = dict(devices=["cpu"], plan="measured", optimizer_placement="device")
SHAPE = dict(hidden=64, layers=12, heads=4, kv_heads=2, head_dim=16, intermediate=192, vocab=256, seq=64, batch=8)


def qwen3_config(shape: dict):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                       max_position_embeddings=shape["seq"], tie_word_embeddings=False, attention_dropout=0.0,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(shape: dict):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(qwen3_config(shape), attn_implementation="sdpa")


def batches(shape: dict, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen) for _ in range(count)]


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


class PlainLoop:
    """The plain torch loop's step: forward with labels, backward, clip, AdamW step, zero_grad, the loss read."""

    name = "plain torch"

    def __init__(self, shape: dict) -> None:
        self.model = build_model(shape)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, ids: torch.Tensor) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def close(self) -> None:
        pass


class EngineLoop:
    """The engine's step: `forward_backward`, the optimizer's exact clip, step, zero_grad, the loss read, and a
    synchronize so that the optimizer's work of the step is inside its time. `cpu_rng` False runs the CPU worker's
    layers without its RNG mode (`_without_cpu_rng_mode`). Building it times `prepare` (`wrap_model` and
    `wrap_optimizer`) and the first step (the measured pass)."""

    def __init__(self, shape: dict, cpu_rng: bool) -> None:
        from accelerate_roundpipe import RoundPipeConfig, wrap_model

        self.name = "roundpipe" if cpu_rng else "roundpipe, no CPU RNG"
        self.cpu_rng = cpu_rng
        self.thread_profiles: _ThreadProfiles | None = None
        model = build_model(shape)
        start = time.perf_counter()
        self.engine = wrap_model(model, RoundPipeConfig(**ENGINE_SETTINGS, summary=False))
        self.optimizer = self.engine.wrap_optimizer(torch.optim.AdamW(self.engine.parameters(), lr=1e-3))
        self.prepare_s = time.perf_counter() - start
        start = time.perf_counter()
        self.step(batches(shape, 1)[0])
        self.first_step_s = time.perf_counter() - start

    def step(self, ids: torch.Tensor) -> float:
        with contextlib.nullcontext() if self.cpu_rng else _without_cpu_rng_mode():
            loss = self.engine.forward_backward(input_ids=ids, labels=ids)
            self.optimizer.clip_grad_norm_(1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
            value = loss.item()
            self.engine.synchronize()
        return value

    def close(self) -> None:
        self.engine.close()


def interleaved(systems: list, shape: dict, steps: int, warmup: int, block: int) -> dict[str, dict]:
    """Each system's median step (wall clock, and CPU time of every thread of the process), the systems taking
    turns `block` steps at a time so that a busy machine slows them alike; the first `warmup` steps of each are not
    timed."""
    data = batches(shape, steps + warmup)
    for system in systems:
        for ids in data[:warmup]:
            system.step(ids)
    times = {system.name: ([], []) for system in systems}
    for first in range(warmup, steps + warmup, block):
        for system in systems:
            wall, cpu = times[system.name]
            for ids in data[first:first + block]:
                start, start_cpu = time.perf_counter(), time.process_time()
                system.step(ids)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
    return {name: {"median_step_ms": _median_ms(wall), "cpu_step_ms": _median_ms(cpu)}
            for name, (wall, cpu) in times.items()}


class _ThreadProfiles:
    """cProfile in every thread started from now on (the engine's workers, optimizer and commit threads), each
    enabled while `active` is set: cProfile alone sees only the thread that enables it."""

    def __init__(self) -> None:
        self.active = False
        self.profiles: dict[str, cProfile.Profile] = {}
        self._run = threading.Thread.run
        profiles, original = self, self._run

        def run(thread):
            profiler = profiles.profiles[f"{thread.name} #{len(profiles.profiles)}"] = cProfile.Profile()
            sys.setprofile(None)

            def switch(frame, event, arg):  # enable once `active` is set, from inside the thread itself
                if profiles.active:
                    sys.setprofile(None)
                    profiler.enable()
            threading.setprofile(None)
            sys.setprofile(switch)
            try:
                original(thread)
            finally:
                profiler.disable()
        threading.Thread.run = run

    def restore(self) -> None:
        threading.Thread.run = self._run

    def report(self, top: int) -> str:
        text = io.StringIO()
        for name, profiler in sorted(self.profiles.items()):
            try:
                stats = pstats.Stats(profiler, stream=text)
            except TypeError:  # never enabled
                continue
            text.write(f"==== thread {name}\n")
            stats.sort_stats("tottime").print_stats(top)
            text.write(f"==== thread {name}, the engine's own functions\n")
            stats.sort_stats("tottime").print_stats("accelerate_roundpipe", top)
        return text.getvalue()


@contextlib.contextmanager
def _without_cpu_rng_mode():
    """CPU workers' layer runs without their RNG dispatch mode ([Note: CPU worker RNG]): a CUDA worker has none, so
    what is left is the host work a GPU worker's layer runs also do. The model draws no random numbers (no dropout),
    so the numbers are the same."""
    from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice

    original = CpuDevice.rng
    CpuDevice.rng = lambda self, seed: contextlib.nullcontext()
    try:
        yield
    finally:
        CpuDevice.rng = original


def profile_engine(system: EngineLoop, shape: dict, steps: int, top: int = 40) -> str:
    """cProfile of `steps` engine steps: the caller's thread (cumulative) and every engine thread (own time)."""
    profiler = cProfile.Profile()
    system.thread_profiles.active = True
    profiler.enable()
    for ids in batches(shape, steps):
        system.step(ids)
    profiler.disable()
    system.thread_profiles.active = False
    text = io.StringIO()
    text.write("==== thread caller\n")
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue() + system.thread_profiles.report(top)


class _StepClock:
    """Trainer callback: wall clock at train begin, at each step's start and end."""

    def __init__(self, profile_from: int | None = None) -> None:
        from transformers import TrainerCallback

        clock = self
        self.profiler = None if profile_from is None else cProfile.Profile()
        self.profile_from = profile_from

        class Callback(TrainerCallback):
            def on_train_begin(self, *args, **kwargs):
                clock.train_begin = time.perf_counter()

            def on_step_begin(self, *args, **kwargs):
                clock.step_begins.append(time.perf_counter())
                if clock.profiler is not None and len(clock.step_begins) == clock.profile_from:
                    clock.profiler.enable()

            def on_step_end(self, *args, **kwargs):
                clock.step_ends.append(time.perf_counter())
                clock.step_end_cpu.append(time.thread_time())

        self.callback = Callback()
        self.train_call: float | None = None  # train() called: the Trainer prepares the model and the optimizer
        self.train_begin: float | None = None
        self.step_begins: list[float] = []
        self.step_ends: list[float] = []
        self.step_end_cpu: list[float] = []  # the caller thread's CPU time (its own work, not its waits)


def trainer_run(shape: dict, steps: int, warmup: int, roundpipe: bool, profile: bool = False) -> dict:
    """One Trainer's run (the engine's CPU worker without its RNG mode, as a CUDA worker); with `profile`, cProfile
    of the caller's thread over the steps past the warm-up."""
    with _without_cpu_rng_mode():
        return _trainer_run(shape, steps, warmup, roundpipe, profile)


def _trainer_run(shape: dict, steps: int, warmup: int, roundpipe: bool, profile: bool) -> dict:
    import tempfile

    from transformers import PrinterCallback, Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    model = build_model(shape)
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(shape, (steps + warmup) * shape["batch"])]
    clock = _StepClock(profile_from=warmup + 1 if profile else None)
    with tempfile.TemporaryDirectory(prefix="host_overhead_") as output_dir:
        common = dict(output_dir=output_dir, max_steps=steps + warmup, per_device_train_batch_size=shape["batch"],
                      learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                      disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False, seed=0)
        if roundpipe:
            settings = {f"roundpipe_{k}": v for k, v in ENGINE_SETTINGS.items()}
            settings["roundpipe_devices"] = ",".join(ENGINE_SETTINGS["devices"])
            args = RoundPipeTrainingArguments(**common, **settings, roundpipe_summary=False)
            trainer_class = RoundPipeTrainer
        else:
            args = TrainingArguments(**common)
            trainer_class = Trainer
        trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[clock.callback])
        trainer.remove_callback(PrinterCallback)
        clock.train_call = time.perf_counter()
        trainer.train()
        if clock.profiler is not None:
            clock.profiler.disable()
        engine = getattr(trainer, "roundpipe_engine", None)
        if engine is not None:
            engine.close()
    steps_s = [b - a for a, b in zip(clock.step_ends[warmup:], clock.step_ends[warmup + 1:])]
    cpu_s = [b - a for a, b in zip(clock.step_end_cpu[warmup:], clock.step_end_cpu[warmup + 1:])]
    out = {"median_step_ms": _median_ms(steps_s), "caller_cpu_ms": _median_ms(cpu_s),
           "prepare_ms": round((clock.step_begins[0] - clock.train_call) * 1e3, 1),
           "first_step_ms": round((clock.step_ends[0] - clock.step_begins[0]) * 1e3, 1)}
    if clock.profiler is not None:
        text = io.StringIO()
        pstats.Stats(clock.profiler, stream=text).sort_stats("cumulative").print_stats(60)
        out["profile"] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("loop", "trainer", "both"), default="loop")
    parser.add_argument("--steps", type=int, default=120, help="timed steps of each system")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of each system first")
    parser.add_argument("--block", type=int, default=5, help="steps a system runs before the next one's turn")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then cProfile this many steps of the engine (without the CPU RNG mode unless --cpu-rng)")
    parser.add_argument("--cpu-rng", action="store_true", help="profile the engine with its CPU worker's RNG mode")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (compute is negligible)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"shape: {SHAPE}; torch threads {args.threads}; {args.steps} steps each after {args.warmup}, "
          f"in turns of {args.block}")
    if args.mode in ("loop", "both"):
        thread_profiles = _ThreadProfiles() if args.profile else None  # before the engines start their threads
        systems = [PlainLoop(SHAPE), EngineLoop(SHAPE, cpu_rng=True), EngineLoop(SHAPE, cpu_rng=False)]
        results = interleaved(systems, SHAPE, args.steps, args.warmup, args.block)
        for system in systems:
            record = results[system.name]
            line = (f"loop     {system.name:<22} median step {record['median_step_ms']:8.3f} ms   "
                    f"(CPU time of all threads {record['cpu_step_ms']:8.3f} ms)")
            if isinstance(system, EngineLoop):
                line += f"   prepare {system.prepare_s * 1e3:7.1f} ms   first step {system.first_step_s * 1e3:7.1f} ms"
            print(line)
        if args.profile:
            profiled = systems[1] if args.cpu_rng else systems[2]
            profiled.thread_profiles = thread_profiles
            print(profile_engine(profiled, SHAPE, args.profile))
            thread_profiles.restore()
        for system in systems:
            system.close()
    if args.mode in ("trainer", "both"):
        plain = trainer_run(SHAPE, args.steps, args.warmup, roundpipe=False, profile=bool(args.profile))
        engine = trainer_run(SHAPE, args.steps, args.warmup, roundpipe=True, profile=bool(args.profile))
        for name, record in (("Trainer", plain), ("RoundPipeTrainer", engine)):
            print(f"trainer  {name:<16} median step {record['median_step_ms']:8.3f} ms   "
                  f"(CPU time of the caller's thread {record['caller_cpu_ms']:8.3f} ms)   "
                  f"prepare {record['prepare_ms']:7.1f} ms   first step {record['first_step_ms']:7.1f} ms")
        for name, record in (("Trainer", plain), ("RoundPipeTrainer", engine)):
            if "profile" in record:
                print(f"==== {name}, the caller's thread\n{record['profile']}")


if __name__ == "__main__":
    main()
