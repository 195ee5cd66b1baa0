"""`RoundPipeConfig`: every engine knob, its help text and its `ROUNDPIPE_*` environment variable.

This is the one module that reads the environment. `None` on a field means "the caller said nothing": the
`ROUNDPIPE_<FIELD>` variable is used when set, otherwise the documented default. An explicit argument beats the
environment, and the environment beats the default. Strings are normalised to their final types here, once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

ENV_PREFIX = "ROUNDPIPE_"
RECOMPUTE_GRAINS = ("stage", "layer")
KERNEL_CHOICES = ("auto", "liger", "none")
PLAN_CHOICES = ("measured", "static")
_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


def str_to_bool(value: str, name: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use one of {_TRUE + _FALSE}.")


def to_dtype(value: Any, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    text = str(value).strip().lower().removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
               "fp64": "float64", "double": "float64"}
    dtype = getattr(torch, aliases.get(text, text), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name}={value!r} is not a floating-point torch dtype (e.g. 'bfloat16', 'float32').")
    return dtype


def _int_list(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        out = [int(v) for v in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a list of layer counts, e.g. '3,3,2'.") from None
    if not out or any(v < 1 for v in out):
        raise ValueError(f"{name}={value!r}: every stage needs at least one layer.")
    return out


def _count_or_auto(value: Any, name: str) -> int | str:
    """A count of at least 1, or "auto" (any case)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or (isinstance(value, float) and value != count):
        raise ValueError(f"{name} (env {ENV_PREFIX}{name.upper()}) must be an integer >= 1 or 'auto', "
                         f"got {value!r}.")
    return count


def _gib(value: Any, name: str) -> float:
    """GiB from a number or a string such as '24', '24GiB', '24 GB' (GB taken as GiB: budgets are approximate)."""
    text = str(value).strip().lower().replace(" ", "")
    for unit in ("gib", "gb", "g"):
        text = text.removesuffix(unit)
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a memory size; use GiB, e.g. 24 or '24GiB'.") from None
    if gib <= 0:
        raise ValueError(f"{name}={value!r} must be positive.")
    return gib


def check_cuda_devices(devices: list[torch.device]) -> None:
    """Refuse CUDA workers this machine cannot run, naming the setting (else the first pinned buffer fails deep
    inside torch with "Torch not compiled with CUDA enabled")."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return
    named = ",".join(str(d) for d in devices)
    fix = (f"Set devices to CPU workers (env {ENV_PREFIX}DEVICES=cpu,cpu, --roundpipe_devices cpu,cpu, or "
           f"`devices: cpu,cpu` in the `roundpipe:` section), or leave it unset to use every visible GPU.")
    if not torch.cuda.is_available():
        why = ("this PyTorch was built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)")
        raise ValueError(f"devices (env {ENV_PREFIX}DEVICES)={named!r} names CUDA devices, but {why} "
                         f"(torch {torch.__version__}). {fix}")
    count = torch.cuda.device_count()
    missing = [str(d) for d in cuda if (d.index or 0) >= count]
    if missing:
        raise ValueError(f"devices (env {ENV_PREFIX}DEVICES)={named!r} names {', '.join(missing)}, but only {count} "
                         f"CUDA GPU(s) are visible (cuda:0 to cuda:{count - 1}). Name visible GPUs only. {fix}")


@dataclass(kw_only=True)
class RoundPipeConfig:
    """Configuration of a RoundPipe engine.

    Args:
        devices (`list[str]`, env `ROUNDPIPE_DEVICES`): workers, e.g. `["cuda:0", "cuda:1"]` or `["cpu", "cpu"]`.
            Each entry is a separate stateless worker with its own copies. Default: every visible GPU, else one CPU
            worker.
        num_microbatches (`int`, env `ROUNDPIPE_NUM_MICROBATCHES`): micro-batches per `forward_backward` call.
            Default: twice the device count, lowered to the batch size for small batches.
        microbatches_per_round (`int`, env `ROUNDPIPE_MICROBATCHES_PER_ROUND`): micro-batches each dispatched task
            runs. Default: all micro-batches of the call (one round: each weight crosses PCIe once per direction per
            iteration). Smaller rounds bound the host memory kept for recomputation; below the device count they
            leave idle gaps in each round.
        async_optimizer (`bool`, env `ROUNDPIPE_ASYNC_OPTIMIZER`): step the optimizer one iteration late, in the
            background (staleness 1). Default: false, the exact step: from scratch the lagged step trains a
            measurably worse model (docs/convergence.md); in fine-tuning it costs nothing measurable.
        async_warmup_steps (`int`, env `ROUNDPIPE_ASYNC_WARMUP_STEPS`): with `async_optimizer`, the first this many
            steps are exact, the lagged ones follow (the delayed update of ZeRO-Offload starts after a warm-up
            too). Default: 0. Its measured effect is in docs/convergence.md.
        param_dtype (`torch.dtype`, env `ROUNDPIPE_PARAM_DTYPE`): dtype of the compute copies. Default: the
            module's own dtypes.
        optimizer_dtype (`torch.dtype`, env `ROUNDPIPE_OPTIMIZER_DTYPE`): dtype of the optimizer copies and host
            gradients. Default: float32, or the parameter's dtype when that is wider (float64 stays float64).
        recompute (`str`, env `ROUNDPIPE_RECOMPUTE`): "stage" recomputes a backward stage's forward as one graph;
            "layer" recomputes and back-propagates one layer at a time (less GPU memory, more input uploads).
            Default: "stage".
        plan (`str`, env `ROUNDPIPE_PLAN`): "measured" times every layer and reads its activation memory on the
            first training pass, then re-plans the partition from those costs under `gpu_memory_budget` (one device:
            no recomputation where memory allows; several: the slowest stage as fast as memory allows); "static"
            keeps the partition planned from unit costs. Ignored when `forward_stages`/`backward_stages` are given.
            Default: "measured" when every device is a GPU, else "static".
        forward_stages (`list[int]`, env `ROUNDPIPE_FORWARD_STAGES`): layer counts of the forward stages, bottom
            to top, covering every layer below the fused stage. Default: planned from layer costs.
        backward_stages (`list[int]`, env `ROUNDPIPE_BACKWARD_STAGES`): layer counts of the backward stages,
            bottom to top; the last one is the fused stage. Default: planned from layer costs.
        seed (`int`, env `ROUNDPIPE_SEED`): base seed of the per-layer, per-micro-batch RNG streams (dropout masks
            are replayed exactly in recomputation). Default: `torch.initial_seed()` when the engine is built.
        pin_memory (`bool`, env `ROUNDPIPE_PIN_MEMORY`): page-lock the host store. Default: true when a CUDA
            device is used.
        wait_timeout_s (`float`, env `ROUNDPIPE_WAIT_TIMEOUT_S`): a thread waiting longer than this on another
            raises instead of hanging. Default: 600.
        trace_path (`str`, env `ROUNDPIPE_TRACE_PATH` or `ROUNDPIPE_TRACE`): write a Chrome/Perfetto timeline of
            every worker, commit thread, the optimizer and the caller here (at the end of `Trainer.train()`,
            `accelerator.end_training()`, `close()`, `save_trace()`, and at exit). Default: no recording.
        summary (`bool`, env `ROUNDPIPE_SUMMARY`): print one summary of the engine's settings (devices, plan,
            micro-batches, recompute, optimizer, clipping, host memory) to stderr when it starts, and where the
            trace is written. Default: true.
        peak_tflops (`float`, env `ROUNDPIPE_PEAK_TFLOPS`): the peak dense TFLOP/s of one device, for the MFU in
            training logs. Default: unknown (no MFU logged).
        kernels (`str`, env `ROUNDPIPE_KERNELS`): fused decoder-layer kernels for Hugging Face models: "auto"
            applies Liger-Kernel's RMSNorm, SwiGLU and RoPE when it is installed and every device is a GPU;
            "liger" requires them; "none" runs the model's own layers. Default: "auto".
        mlp_chunk_tokens (`int`, env `ROUNDPIPE_MLP_CHUNK_TOKENS`): for Hugging Face models, run each decoder
            layer's dense MLP over chunks of this many tokens when a micro-batch has more, keeping only the MLP's
            input for the backward (see `models/tiled_mlp.py`): long sequences fit in less GPU memory for one more
            MLP forward per backward. Default: off.
        head_shards (`int` or "auto", env `ROUNDPIPE_HEAD_SHARDS`): for Hugging Face models, cut the head (final
            norm, lm_head, loss) into this many pipeline layers, one per vocabulary shard, carrying online-softmax
            statistics between them (see [Note: vocabulary shards] in `models/vocab_shards.py`), so the planner can
            spread a long-vocabulary head over several stages; "auto" takes the count the planner picks from the
            model's FLOPs for the devices in use (1 on one device). Each shard still uploads the whole head weight
            (the host store has no row-range buckets yet). Default: 1 (one head layer).
        gpu_memory_budget (`float` GiB or a string like "24GiB", env `ROUNDPIPE_GPU_MEMORY_BUDGET`): GPU memory
            the engine plans with, per device. Half of it may hold saved layer inputs on the device instead of the
            host (see [Note: saved inputs]). Default: what the GPU has (CPU workers: saved inputs go through the
            host copy path, as on a GPU).
        data_parallel (`bool`, env `ROUNDPIPE_DATA_PARALLEL`): run as one rank of a data-parallel group over
            `torch.distributed` (one process per machine, each an engine over its local devices; see
            [Note: data parallel] in `runtime/data_parallel.py`). True requires an initialized process group; False
            refuses to build an engine in a run of several processes. Default: on when a process group of more than
            one process is initialized.
    """

    devices: list[str] | None = field(default=None, metadata={
        "help": "Workers, e.g. 'cuda:0,cuda:1' or 'cpu,cpu'. Default: every visible GPU, else one CPU worker."})
    num_microbatches: int | None = field(default=None, metadata={
        "help": "Micro-batches per forward_backward call. Default: 2 x devices, lowered to the batch size."})
    microbatches_per_round: int | None = field(default=None, metadata={
        "help": "Micro-batches each dispatched task runs. Default: all of the call's micro-batches (one round)."})
    async_optimizer: bool | None = field(default=None, metadata={
        "help": "Step the optimizer one iteration late in the background (staleness 1). Default: false (exact)."})
    async_warmup_steps: int | None = field(default=None, metadata={
        "help": "With async_optimizer: take this many exact steps before lagging (a warm-up). Default: 0."})
    param_dtype: torch.dtype | str | None = field(default=None, metadata={
        "help": "dtype of the compute copies (e.g. bfloat16). Default: the module's own dtypes."})
    optimizer_dtype: torch.dtype | str | None = field(default=None, metadata={
        "help": "dtype of optimizer copies and host gradients. Default: float32 (or wider if the parameter is)."})
    recompute: str | None = field(default=None, metadata={
        "help": "Backward recomputation grain: 'stage' or 'layer'. Default: 'stage'."})
    plan: str | None = field(default=None, metadata={
        "help": "'measured': re-plan from costs measured on the first pass; 'static'. Default: measured on GPUs."})
    forward_stages: list[int] | None = field(default=None, metadata={
        "help": "Layer counts of forward stages below the fused stage, e.g. '3,3'. Default: planned from costs."})
    backward_stages: list[int] | None = field(default=None, metadata={
        "help": "Layer counts of backward stages bottom to top; the last is fused. Default: planned from costs."})
    seed: int | None = field(default=None, metadata={
        "help": "Base seed of the per-layer RNG streams replayed in recomputation. Default: torch.initial_seed()."})
    pin_memory: bool | None = field(default=None, metadata={
        "help": "Page-lock the host store. Default: true when a CUDA device is used."})
    wait_timeout_s: float | None = field(default=None, metadata={
        "help": "Seconds a thread may wait on another before raising instead of hanging. Default: 600."})
    trace_path: str | None = field(default=None, metadata={
        "help": "Write a Chrome/Perfetto timeline trace here (env ROUNDPIPE_TRACE also works). Default: off.",
        "env_aliases": ("ROUNDPIPE_TRACE",)})
    summary: bool | None = field(default=None, metadata={
        "help": "Print one summary of the engine's settings to stderr when it starts. Default: true."})
    peak_tflops: float | None = field(default=None, metadata={
        "help": "Peak dense TFLOP/s of one device, for the MFU in training logs. Default: unknown (no MFU)."})
    kernels: str | None = field(default=None, metadata={
        "help": "Fused layer kernels for HF models: 'auto' (Liger when installed, on GPUs), 'liger', 'none'."})
    mlp_chunk_tokens: int | None = field(default=None, metadata={
        "help": "HF models: run dense MLPs over chunks of this many tokens (long sequences). Default: off."})
    head_shards: int | str | None = field(default=None, metadata={
        "help": "HF models: the head as this many vocabulary-shard pipeline layers, or 'auto'. Default: 1."})
    gpu_memory_budget: float | str | None = field(default=None, metadata={
        "help": "GPU memory per device the engine plans with, in GiB (e.g. 24 or '24GiB'). Default: the GPU's."})
    data_parallel: bool | None = field(default=None, metadata={
        "help": "Run as one rank of a torch.distributed data-parallel group. Default: on when world size > 1."})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                for name in (ENV_PREFIX + f.name.upper(), *f.metadata.get("env_aliases", ())):
                    raw = os.environ.get(name)
                    if raw is not None and raw.strip() != "":
                        setattr(self, f.name, raw)
                        break
        self._normalise()

    def _normalise(self) -> None:
        env = ENV_PREFIX
        if isinstance(self.devices, str):
            self.devices = [d.strip() for d in self.devices.split(",") if d.strip()]
        if self.devices is not None:
            self.devices = [str(torch.device(d)) if str(d) != "cpu" else "cpu" for d in self.devices]
            if not self.devices:
                raise ValueError(f"devices (env {env}DEVICES) is empty; name at least one, e.g. 'cuda:0' or 'cpu'.")
        for name, least in (("num_microbatches", 1), ("microbatches_per_round", 1), ("mlp_chunk_tokens", 1),
                            ("async_warmup_steps", 0)):
            value = getattr(self, name)
            if value is not None:
                value = int(value)
                if value < least:
                    raise ValueError(f"{name} (env {env}{name.upper()}) must be >= {least}, got {value}.")
                setattr(self, name, value)
        for name in ("async_optimizer", "pin_memory", "summary", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, str_to_bool(value, env + name.upper()))
        self.param_dtype = to_dtype(self.param_dtype, "param_dtype")
        self.optimizer_dtype = to_dtype(self.optimizer_dtype, "optimizer_dtype")
        for name, choices in (("recompute", RECOMPUTE_GRAINS), ("plan", PLAN_CHOICES), ("kernels", KERNEL_CHOICES)):
            value = getattr(self, name)
            if value is not None:
                value = str(value).strip().lower()
                if value not in choices:
                    raise ValueError(f"{name} (env {env}{name.upper()})={value!r}; choose one of {list(choices)}.")
                setattr(self, name, value)
        if self.head_shards is not None:
            self.head_shards = _count_or_auto(self.head_shards, "head_shards")
        self.forward_stages = _int_list(self.forward_stages, "forward_stages")
        self.backward_stages = _int_list(self.backward_stages, "backward_stages")
        if self.seed is not None:
            self.seed = int(self.seed)
        if self.wait_timeout_s is not None:
            self.wait_timeout_s = float(self.wait_timeout_s)
        if self.peak_tflops is not None:
            self.peak_tflops = float(self.peak_tflops)
        if self.gpu_memory_budget is not None:
            self.gpu_memory_budget = _gib(self.gpu_memory_budget, env + "GPU_MEMORY_BUDGET")

    # Resolved values: what the engine actually uses.
    def resolved_devices(self) -> list[torch.device]:
        """The workers; named CUDA devices are checked against what this machine has (an engine asks once)."""
        if self.devices is not None:
            devices = [torch.device(d) for d in self.devices]
            check_cuda_devices(devices)
            return devices
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]

    @property
    def resolved_summary(self) -> bool:
        return True if self.summary is None else self.summary

    @property
    def resolved_async_optimizer(self) -> bool:
        return False if self.async_optimizer is None else self.async_optimizer

    @property
    def resolved_plan(self) -> str:
        if self.forward_stages is not None or self.backward_stages is not None:
            return "static"
        if self.plan is not None:
            return self.plan
        return "measured" if all(d.type == "cuda" for d in self.resolved_devices()) else "static"

    @property
    def resolved_recompute(self) -> str:
        return self.recompute or "stage"

    @property
    def resolved_wait_timeout_s(self) -> float:
        return 600.0 if self.wait_timeout_s is None else self.wait_timeout_s
