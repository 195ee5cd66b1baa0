"""One training run of the convergence benchmark: a system (plain `transformers.Trainer` or `RoundPipeTrainer` with
some RoundPipe settings) trained from given initial weights, returning its record.

Every system gets the same model config, the same initial state dict (built once by the caller and copied), the same
datasets, the same `TrainingArguments` apart from the `roundpipe_*` fields, and the same seed (so the Trainer's
sampler draws the same batches in the same order). What differs is only where the model runs and how it is stepped.
"""

from __future__ import annotations

import dataclasses
import difflib
import tempfile
import time
import typing
from typing import Any

import torch

from accelerate_roundpipe.config import str_to_bool

PLAIN = "hf"  # the system name of the plain Trainer, the baseline every gap is measured against


@dataclasses.dataclass
class System:
    """A named way to train: `roundpipe` None is the plain Trainer; otherwise the `roundpipe_*` training arguments
    (without the prefix) of a `RoundPipeTrainer`, on top of the engine's defaults."""

    name: str
    roundpipe: dict[str, Any] | None = None
    use_liger_kernel: bool = False  # the plain Trainer's own `use_liger_kernel` (Liger's kernels in HF's model)


def builtin_systems() -> dict[str, System]:
    return {PLAIN: System(PLAIN), "hf-liger": System("hf-liger", use_liger_kernel=True),
            "sync": System("sync", {"async_optimizer": False}), "async": System("async", {"async_optimizer": True})}


def _field_types() -> dict[str, type]:
    """`RoundPipeTrainingArguments`' `roundpipe_<key>` fields: key -> the simple type it takes (bool/int/float/str)."""
    from accelerate_roundpipe import RoundPipeTrainingArguments

    out = {}
    for f in dataclasses.fields(RoundPipeTrainingArguments):
        if f.name.startswith("roundpipe_"):
            simple = [t for t in typing.get_args(f.type) if t is not type(None)] or [f.type]
            out[f.name.removeprefix("roundpipe_")] = simple[0]
    return out


def parse_variant(text: str) -> System:
    """`name:key=value,key=value` -> a RoundPipe system whose `roundpipe_<key>` arguments are the values, typed as
    the fields are. An unknown key is an error naming the close matches (a typo must not measure the default)."""
    name, sep, settings = text.partition(":")
    if not sep or not name or name in builtin_systems():
        raise ValueError(f"--variant {text!r}: expected NAME:key=value[,key=value...] with a new NAME "
                         f"(not one of {sorted(builtin_systems())})")
    types = _field_types()
    values: dict[str, Any] = {}
    for item in filter(None, settings.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"--variant {text!r}: {item!r} is not key=value")
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--variant {text!r}: RoundPipeTrainingArguments has no field roundpipe_{key}{hint}; "
                             f"known keys: {', '.join(sorted(types))}")
        kind, raw = types[key], raw.strip()
        values[key] = str_to_bool(raw, key) if kind is bool else kind(raw) if kind in (int, float) else raw
    return System(name, values)


class _History:
    """Trainer callback: each step's training loss and gradient norm, each held-out evaluation."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        history = self

        class Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                history.add(state.global_step, logs or {})

            def on_init_end(self, args, state, control, **kwargs):
                history.init_end = time.perf_counter()

            def on_train_begin(self, args, state, control, **kwargs):
                history.train_begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                history.step_ends.append(time.perf_counter())

        self.callback = Callback()
        self.losses: list[tuple[int, float]] = []
        self.grad_norms: list[tuple[int, float]] = []
        self.evals: list[tuple[int, float]] = []
        self.eval_s: list[float] = []
        self.step_ends: list[float] = []  # wall clock at each optimizer step's end (the Trainer's view)
        self.train_begin: float | None = None
        self.init_end: float | None = None  # the Trainer built; train() follows and prepares the model

    def start_up(self) -> dict:
        """Where a run's fixed cost goes: from the training's start to the first step's end (the engine is built,
        the measured pass planned, kernels compiled there), and the next steps' durations (ms)."""
        if self.train_begin is None or not self.step_ends:
            return {}
        ends = [self.train_begin, *self.step_ends[:12]]
        prepare = {} if self.init_end is None else {"prepare_s": round(self.train_begin - self.init_end, 3)}
        every = [self.train_begin, *self.step_ends]
        return {**prepare, "first_step_s": round(ends[1] - ends[0], 3),
                "early_steps_ms": [round((b - a) * 1e3, 1) for a, b in zip(ends[1:], ends[2:])],
                # every step's wall time (an evaluation's falls in the step after it): where a mean above the
                # median goes (steps after an evaluation, a re-plan, a slow tail)
                "step_ms": [round((b - a) * 1e3, 1) for a, b in zip(every, every[1:])]}

    def median_step_s(self) -> float | None:
        """The median time between two step ends past the first 10 steps (start-up, measured pass and re-plan,
        compilation): the steady state, beside the whole run's tokens/s. Evaluation steps fall out as outliers."""
        times = sorted(b - a for a, b in zip(self.step_ends[10:], self.step_ends[11:]))
        return times[len(times) // 2] if times else None

    def add(self, step: int, logs: dict) -> None:
        if "loss" in logs:
            self.losses.append((step, float(logs["loss"])))
            if logs.get("grad_norm") is not None:
                self.grad_norms.append((step, float(logs["grad_norm"])))
        if "eval_loss" in logs:
            self.evals.append((step, float(logs["eval_loss"])))
            self.eval_s.append(float(logs.get("eval_runtime", 0.0)))


def training_arguments(system: System, regime: dict, sizes: dict, output_dir: str):
    """The `TrainingArguments` (plain) or `RoundPipeTrainingArguments` of one run; only `roundpipe_*` differ."""
    from transformers import TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainingArguments

    cuda = torch.cuda.is_available()
    common = dict(output_dir=output_dir, max_steps=regime["steps"], per_device_train_batch_size=sizes["batch"],
                  per_device_eval_batch_size=sizes["batch"], learning_rate=regime["lr"],
                  lr_scheduler_type=regime["scheduler"], warmup_steps=regime["warmup_steps"],
                  weight_decay=regime["weight_decay"], max_grad_norm=regime["max_grad_norm"],
                  logging_steps=1, eval_strategy="steps", eval_steps=regime["eval_every"], save_strategy="no",
                  report_to=[], disable_tqdm=True, seed=sizes["seed"],
                  data_seed=sizes["seed"] + regime["data_seed_offset"], bf16=sizes["bf16"], use_cpu=not cuda,
                  dataloader_pin_memory=cuda)
    if system.roundpipe is None:
        return TrainingArguments(**common, use_liger_kernel=system.use_liger_kernel)
    roundpipe = {"devices": "cuda:0" if cuda else "cpu,cpu", "num_microbatches": sizes.get("num_microbatches"),
                 **system.roundpipe}
    roundpipe = {k: v for k, v in roundpipe.items() if v is not None}  # None: the engine's default
    return RoundPipeTrainingArguments(**common, **{f"roundpipe_{k}": v for k, v in roundpipe.items()})


def train(system: System, model_config, init_state: dict, train_set, eval_set, regime: dict,
          sizes: dict, callbacks: tuple = ()) -> tuple[dict, dict | None]:
    """Train `system` from `init_state`; returns (its record, the final state dict for the plain Trainer else None).

    The held-out loss at the end is measured after the engine is synchronized, so it is of the weights with every
    step in them; the evaluations during training are the Trainer's own (with the lagged step, RoundPipe's may miss
    the last step's update). tokens/s is over the training wall time less the evaluations' runtime. `callbacks` are
    more Trainer callbacks (a profiler's window, say)."""
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer

    from accelerate_roundpipe import RoundPipeTrainer

    torch.manual_seed(sizes["seed"])
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    model.load_state_dict(init_state)
    history = _History()
    with tempfile.TemporaryDirectory(prefix=f"convergence_{system.name}_") as output_dir:
        args = training_arguments(system, regime, sizes, output_dir)
        trainer_class = Trainer if system.roundpipe is None else RoundPipeTrainer
        trainer = trainer_class(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                callbacks=[history.callback, *callbacks])
        trainer.remove_callback(PrinterCallback)  # one line per step of every run is noise; the records keep it
        start = time.perf_counter()
        trainer.train()
        engine = getattr(trainer, "roundpipe_engine", None)
        if engine is not None:
            engine.synchronize()  # the last (lagged) step inside the clock and inside the weights evaluated below
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
        evals = list(history.evals)  # the Trainer's own, before the final evaluate() below adds its entry
        final_metrics = trainer.evaluate()
        final_eval = float(final_metrics["eval_loss"])
        settings = _settings(trainer, engine, regime, sizes)
        if engine is not None:
            engine.close()
    train_s = wall_s - sum(history.eval_s[:len(evals)])
    tokens = regime["steps"] * sizes["batch"] * sizes["seq"]
    record = {"system": system.name, "settings": settings, "losses": history.losses,
              "grad_norms": history.grad_norms, "evals": evals,
              "final_eval_loss": final_eval, "train_s": round(train_s, 3),
              # what a user waits for: the whole train() (its evaluations included) and each evaluation
              "train_runtime_s": round(wall_s, 3), "eval_runtime_s": [round(t, 3) for t in history.eval_s],
              "final_eval_runtime_s": round(float(final_metrics["eval_runtime"]), 3),
              "final_eval_samples_per_s": round(float(final_metrics["eval_samples_per_second"]), 2),
              "tokens_per_s": round(tokens / train_s, 1)}
    record.update(history.start_up())
    median = history.median_step_s()
    if median is not None:
        record["median_step_ms"] = round(median * 1e3, 3)
        record["tokens_per_s_median_step"] = round(sizes["batch"] * sizes["seq"] / median, 1)
    final_state = None
    if system.roundpipe is None:
        final_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return record, final_state


def _settings(trainer, engine, regime: dict, sizes: dict) -> dict:
    """What a reader needs to know about how this run stepped, clipped and logged."""
    args = trainer.args
    out = {"optimizer_mode": "exact (plain Trainer)" if engine is None else
           "async (lagged one step)" if engine.config.resolved_async_optimizer else "sync (exact)",
           "max_grad_norm": args.max_grad_norm, "logging_steps": args.logging_steps, "optim": str(args.optim),
           "lr": args.learning_rate, "scheduler": str(args.lr_scheduler_type), "warmup_steps": args.warmup_steps,
           "weight_decay": args.weight_decay, "bf16": args.bf16, "device": str(args.device),
           "data_seed": args.data_seed}
    if engine is not None:
        out["roundpipe"] = {k.removeprefix("roundpipe_"): str(v) for k, v in vars(args).items()
                            if k.startswith("roundpipe_") and v is not None}
        out["roundpipe"]["resolved_devices"] = [str(d) for d in engine.config.resolved_devices()]
    return out
