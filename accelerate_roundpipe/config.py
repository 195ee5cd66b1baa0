"""`RoundPipeConfig`: every engine knob, its help text and its `ROUNDPIPE_*` environment variable.

This is the one module that reads the environment. `None` on a field means "the caller said nothing": the
`ROUNDPIPE_<FIELD>` variable is used when set, otherwise the documented default. An explicit argument beats the
environment, and the environment beats the default. Strings are normalised to their final types here, once, and
a value no engine could run is refused here, at construction ([Note: settings checked where given]).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a value needs it: a command line's refusal waits for no torch import
    import torch
else:
    class _TorchOnFirstUse:
        """`torch` for this module (its functions and its annotations, which `typing.get_type_hints` evaluates):
        the real module is imported at the first attribute read, and takes this stand-in's place."""

        def __getattr__(self, name: str):
            import torch

            globals()["torch"] = torch
            return getattr(torch, name)

    torch = _TorchOnFirstUse()

ENV_PREFIX = "ROUNDPIPE_"
# Variables a field is also read from, after its own ROUNDPIPE_<FIELD>: {field: names}. A table beside the fields, not
# a key of their `metadata`: `HfArgumentParser` passes a field's metadata (less "aliases", its extra flags) to
# argparse's `add_argument` as keywords, so any key argparse does not take breaks `HfArgumentParser(RoundPipePlugin)`.
ENV_ALIASES: dict[str, tuple[str, ...]] = {"trace_path": ("ROUNDPIPE_TRACE",)}
RECOMPUTE_GRAINS = ("stage", "layer")
KERNEL_CHOICES = ("auto", "liger", "none")
PLAN_CHOICES = ("measured", "static")
PLACEMENT_CHOICES = ("auto", "host", "device")  # [Note: optimizer placement]
_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


class SettingError(ValueError):
    """A setting refused where it was given ([Note: settings checked where given]): the message names the setting as
    the user wrote it and what it must be. A ValueError, so callers of the Python API catch it as before; the command
    lines (`accelerate-roundpipe`, `python -m accelerate_roundpipe.run`) print it as one `prog: error: ...` line and
    exit with status 2. `source`: "argument" (a Python argument, named generically), "environment" or "given" (a
    `Given` said where)."""

    def __init__(self, message: str, source: str = "argument") -> None:
        super().__init__(message)
        self.source = source


@dataclass(frozen=True)
class Given:
    """Where a setting's value was written, so that a refusal names it there: `spelling` is how a value is written
    in that place, `{value}` (or `{value!r}`) where the value goes ("--devices {value}", "`devices: {value}`",
    "ROUNDPIPE_DEVICES={value!r}"); `place` is what says where that text is (" in the `roundpipe:` section of
    c.yaml"), when the spelling does not. A refusal's fix is spelt the same way."""

    spelling: str
    place: str = ""
    environment: bool = False
    fix_spelling: str = ""  # how a fix is spelt, when not as `spelling` (a field also set by a flag)

    def spell(self, value: Any) -> str:
        return (self.fix_spelling or self.spelling).format(value=value)

    def written(self, value: Any) -> str:
        return self.spelling.format(value=value) + self.place


def environment_variables(field_name: str) -> tuple[str, ...]:
    """The variables setting `field_name` is read from, in order: its own `ROUNDPIPE_<FIELD>`, then its aliases."""
    return (ENV_PREFIX + field_name.upper(), *ENV_ALIASES.get(field_name, ()))


def environment_variable(name: str) -> Given:
    return Given(name + "={value!r}", environment=True)


_BOOLEANS = f"use one of {_TRUE + _FALSE}"


def str_to_bool(value: str, written: str, source: str = "argument") -> bool:
    """`value` as a boolean, else a SettingError that starts with `written`, the setting as the user wrote it
    ("ROUNDPIPE_SUMMARY='maybe'")."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"{written} is not a boolean; {_BOOLEANS}.", source)


def to_dtype(value: Any, written: str, source: str = "argument") -> torch.dtype | None:
    """`value` as a floating-point dtype, else a SettingError that starts with `written`, the setting as written."""
    if value is None or isinstance(value, torch.dtype):
        return value
    text = str(value).strip().lower().removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
               "fp64": "float64", "double": "float64"}
    dtype = getattr(torch, aliases.get(text, text), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SettingError(f"{written} is not a floating-point torch dtype (e.g. 'bfloat16', 'float32').", source)
    return dtype


def knob(name: str) -> str:
    """A setting as the user can give it: the field (of `RoundPipeConfig`, `RoundPipePlugin`, the `roundpipe:` section
    and `accelerate-roundpipe config --<field>`), the `--roundpipe_<field>` training argument and the variable. What a
    refusal names when it does not know where the value came from (a Python argument)."""
    return f"{name} (--roundpipe_{name}, env {ENV_PREFIX}{name.upper()})"


def _refusal(name: str, value: Any, allowed: str, given: Given | None) -> SettingError:
    if given is None:
        return SettingError(f"{knob(name)} must be {allowed}; got {value!r}.")
    # as the user wrote it first: a variable may have been exported long ago, a file written by someone else
    return SettingError(f"{given.written(value)}: {name} must be {allowed}.", _source(given))


def _source(given: Given | None) -> str:
    return "argument" if given is None else "environment" if given.environment else "given"


@dataclass(frozen=True)
class NumberRange:
    """What a numeric setting accepts: an integer in [least, most], or a finite number above 0 (`what` says of
    what); `auto` also takes "auto" (any case); `units` are suffixes the text may carry ('24GiB')."""

    integer: bool
    least: int = 0
    most: int | None = None
    auto: bool = False
    what: str = "number"
    units: tuple[str, ...] = ()

    @property
    def allowed(self) -> str:
        if self.integer:
            text = f"an integer >= {self.least}" if self.most is None else \
                f"an integer from {self.least} to {self.most}"
        else:
            text = f"a positive, finite {self.what}"
        return text + (" or 'auto'" if self.auto else "")


# [Note: settings checked where given]
# Every numeric field of `RoundPipeConfig` has its range here, and construction refuses anything outside it, naming
# the knob (`knob`) and the range: a NaN timeout would otherwise disable every timeout, a zero one fail only at the
# first wait, and a negative budget or TFLOP/s poison a plan or a log much later. Devices are checked against this
# machine at construction too (`check_cuda_devices`). `RoundPipePlugin`, `RoundPipeTrainingArguments` and the
# launchers construct one where the settings are given, so a bad setting stops a script before it loads or tokenizes
# anything. tests/test_setting_checks.py finds the numeric fields from their types: a new one cannot skip its range.
# A refusal (`SettingError`) names the value where the user wrote it, as the user wrote it: the variable read here, or
# what the caller says in `sources` (`Given`: a config file's key, a command's flag, a training argument); a Python
# argument, whose source only the caller's code knows, by the field, its flag and its variable (`knob`). Naming the
# variable for a value that came from elsewhere sends the user looking for an export that does not exist.
NUMBER_RANGES: dict[str, NumberRange] = {
    "num_microbatches": NumberRange(integer=True, least=1),
    "microbatches_per_round": NumberRange(integer=True, least=1),
    "async_warmup_steps": NumberRange(integer=True, least=0),
    "seed": NumberRange(integer=True, least=0, most=2**64 - 1),  # torch.initial_seed()'s range
    "wait_timeout_s": NumberRange(integer=False, what="number of seconds"),
    "peak_tflops": NumberRange(integer=False, what="number of TFLOP/s"),
    "mlp_chunk_tokens": NumberRange(integer=True, least=1),
    "head_shards": NumberRange(integer=True, least=1, auto=True),
    "gpu_memory_budget": NumberRange(integer=False, what="size in GiB (e.g. 24 or '24GiB')",
                                     units=("gib", "gb", "g")),
    "optimizer_device_budget": NumberRange(integer=False, what="size in GiB (e.g. 8 or '8GiB')",
                                           units=("gib", "gb", "g")),
    "host_memory_budget": NumberRange(integer=False, what="size in GiB (e.g. 96 or '96GiB')",
                                      units=("gib", "gb", "g")),
}


def _parse_number(value: Any, units: tuple[str, ...] = ()) -> int | float | None:
    if isinstance(value, bool):
        return None  # True is an int to Python, not a count or a timeout to anyone
    if isinstance(value, (int, float)):
        return value
    text = str(value).strip().lower().replace(" ", "")
    for unit in units:
        text = text.removesuffix(unit)
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return None


def number_setting(value: Any, name: str, rule: NumberRange, given: Given | None = None) -> int | float | str:
    """`value` as the setting `name` takes it (see [Note: settings checked where given]), or a ValueError naming it."""
    if rule.auto and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number = _parse_number(value, rule.units)
    if number is not None and math.isfinite(number):
        if rule.integer and (isinstance(number, int) or number.is_integer()):
            number = int(number)
            if number >= rule.least and (rule.most is None or number <= rule.most):
                return number
        elif not rule.integer and number > 0:
            return float(number)
    raise _refusal(name, value, rule.allowed, given)


def _int_list(value: Any, name: str, given: Given | None = None) -> list[int] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    counts = [_parse_number(v) for v in items]
    if not counts or any(c is None or not math.isfinite(c) or c != int(c) or c < 1 for c in counts):
        raise _refusal(name, value, "a list of layer counts, e.g. '3,3,2' (every stage needs at least one layer)",
                       given)
    return [int(c) for c in counts]


def _folder_setting(value: Any, name: str, given: Given | None = None) -> str:
    """A folder setting: a non-empty path, `~` expanded; whether it can hold what goes there is checked where that
    is known (the disk tier's `check_offload_dir`, before anything is written)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise _refusal(name, value, "a folder path (a local disk, e.g. /scratch/roundpipe)", given)
    return os.path.expanduser(value.strip())


WORKER_TYPES = ("cuda", "cpu")
_WORKER_SPELLING = re.compile(r"(cuda|cpu)(:\d+)?")


def _device_list(value: Any, given: Given | None = None) -> list[str]:
    """Parse `devices` ('cuda:0,cuda:1', ['cpu', 'cpu']): only GPUs and CPU workers are RoundPipe workers."""
    items = [d.strip() for d in value.split(",") if d.strip()] if isinstance(value, str) else list(value)
    if not items:
        raise _refusal("devices", value, "at least one worker, e.g. 'cuda:0' or 'cpu'", given)
    out = []
    for item in items:
        device = None
        # a string no worker is spelt like is refused before torch is imported (a command line's typo)
        if not isinstance(item, str) or _WORKER_SPELLING.fullmatch(item.strip()):
            try:
                device = torch.device(item.strip() if isinstance(item, str) else item)
            except (RuntimeError, TypeError):
                device = None
        if device is None or device.type not in WORKER_TYPES:
            raise _refusal("devices", value, f"a list of workers: GPUs as 'cuda:N' (or 'cuda') and CPU workers as "
                                             f"'cpu', e.g. 'cuda:0,cuda:1' or 'cpu,cpu' ({item!r} is not one)",
                           given)
        if device.type == "cpu" and device.index is not None:
            # torch takes 'cpu:1' and puts its tensors on the one CPU: the index would mean nothing, silently.
            written = given.written(value) if given else f"{knob('devices')}={value!r}"
            example = f": {given.spell('cpu,cpu')}" if given else ""
            raise SettingError(f"{written}: CPU workers are written 'cpu', one entry per worker (e.g. 'cpu,cpu' for "
                               f"two{example}); {str(item).strip()!r} would run as 'cpu' (a CPU worker is a thread "
                               f"of this process, on no particular CPU).", _source(given))
        out.append(str(device))
    return out


def check_cuda_devices(devices: list[torch.device], given: Given | None = None, value: Any = None) -> None:
    """Refuse CUDA workers this machine cannot run, naming the setting (else the first pinned buffer fails deep
    inside torch with "Torch not compiled with CUDA enabled"); `given`: where `value`, the devices as written, was
    given, when known."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return
    named = ",".join(str(d) for d in devices)
    if given is None:
        written = f"devices (env {ENV_PREFIX}DEVICES)={named!r}"
        fix = (f"Set devices to CPU workers (env {ENV_PREFIX}DEVICES=cpu,cpu, --roundpipe_devices cpu,cpu, or "
               f"`devices: cpu,cpu` in the `roundpipe:` section), or leave it unset to use every visible GPU.")
    else:
        written = given.written(named if value is None else value)
        fix = f"Set CPU workers ({given.spell('cpu,cpu')}), or leave devices unset to use every visible GPU."
    if not torch.cuda.is_available():
        why = ("this PyTorch was built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)")
        raise SettingError(f"{written} names CUDA devices, but {why} (torch {torch.__version__}). {fix}",
                           _source(given))
    count = torch.cuda.device_count()
    missing = [str(d) for d in cuda if (d.index or 0) >= count]
    if missing:
        raise SettingError(f"{written} names {', '.join(missing)}, but only {count} CUDA GPU(s) are visible (cuda:0 "
                           f"to cuda:{count - 1}). Name visible GPUs only. {fix}", _source(given))


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
            model's FLOPs for the devices in use (1 on one device). Each shard uploads only its rows of the head
            weight and downloads only their gradient ([Note: row windows] in `runtime/state/host_store.py`). Default: 1
            (one head layer).
        gpu_memory_budget (`float` GiB or a string like "24GiB", env `ROUNDPIPE_GPU_MEMORY_BUDGET`): GPU memory
            the engine plans with, per device. Half of it may hold saved layer inputs on the device instead of the
            host (see [Note: saved inputs]). Default: what the GPU has (CPU workers: saved inputs go through the
            host copy path, as on a GPU).
        optimizer_placement (`str`, env `ROUNDPIPE_OPTIMIZER_PLACEMENT`): where each trainable bucket's optimizer
            state, float32 master weights and gradients live ([Note: optimizer placement] in
            `runtime/state/placement.py`): "device" keeps as many buckets as fit in `optimizer_device_budget` on a GPU
            (bottom layers and tied embeddings first), stepped there by the optimizer's CUDA kernel with nothing
            crossing PCIe; "host" keeps every bucket in host memory, stepped by the CPU; "auto" is "device" on GPUs
            (one process) with the budget's default share, else "host". Default: "auto".
        optimizer_device_budget (`float` GiB or a string like "8GiB", env `ROUNDPIPE_OPTIMIZER_DEVICE_BUDGET`): GPU
            memory, per device, that optimizer placement may fill (20 bytes a parameter with AdamW). Default: half
            of `gpu_memory_budget` (the other half stays for stages and saved inputs); no limit for CPU workers.
        host_memory_budget (`float` GiB or a string like "96GiB", env `ROUNDPIPE_HOST_MEMORY_BUDGET`): host memory
            the engine's store may fill (compute copies, optimizer copies, gradients, optimizer state); past it the
            optimizer copies and states of the top layers' buckets live in swap files under `offload_dir`, read
            ahead of their step and written back after ([Note: disk tier] in `runtime/state/disk_tier.py`).
            Default: the memory available when the optimizer is wrapped (the store's own included) less a headroom
            of 20% (at least 4 GiB).
        offload_dir (`str`, env `ROUNDPIPE_OFFLOAD_DIR`): the folder of the disk tier's swap files (a local disk;
            never tmpfs, which is memory). Made only when a bucket goes to disk; the files are removed at
            `close()`, and a killed run's at the next start. Default: `$XDG_CACHE_HOME/roundpipe/offload`
            (`~/.cache/roundpipe/offload` when `XDG_CACHE_HOME` is unset).
        data_parallel (`bool`, env `ROUNDPIPE_DATA_PARALLEL`): run as one rank of a data-parallel group over
            `torch.distributed` (one process per machine, each an engine over its local devices; see
            [Note: data parallel] in `runtime/distribution/gloo_exchange.py`). True requires an initialized process
            group; False refuses to build an engine in a run of several processes. Default: on when a process group of
            more than one process is initialized.
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
        "help": "Write a Chrome/Perfetto timeline trace here (env ROUNDPIPE_TRACE also works). Default: off."})
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
    optimizer_placement: str | None = field(default=None, metadata={
        "help": "Where optimizer state lives: 'auto' (as much on the GPU as fits), 'host', 'device'. Default: auto."})
    optimizer_device_budget: float | str | None = field(default=None, metadata={
        "help": "GPU memory per device optimizer placement may fill, in GiB. Default: half of the GPU budget."})
    # "percent", not the sign: argparse %-formats every help text it prints, and a lone "%" fails each --help
    # built from these (HfArgumentParser's, accelerate-roundpipe config's).
    host_memory_budget: float | str | None = field(default=None, metadata={
        "help": "Host memory the store may fill, in GiB; past it optimizer state goes to offload_dir. Default: "
                "the memory available less 20 percent."})
    offload_dir: str | None = field(default=None, metadata={
        "help": "Folder of the disk tier's swap files. Default: $XDG_CACHE_HOME/roundpipe/offload "
                "(~/.cache/roundpipe/offload)."})
    data_parallel: bool | None = field(default=None, metadata={
        "help": "Run as one rank of a torch.distributed data-parallel group. Default: on when world size > 1."})

    # Where each value was written, when the caller knows: {field: Given}; a refusal names it there
    # ([Note: settings checked where given]). Not a field: it is no setting, and every list of settings is
    # `dataclasses.fields`.
    sources: InitVar[dict[str, Given] | None] = None

    def __post_init__(self, sources: dict[str, Given] | None = None) -> None:
        self._given = {name: given for name, given in (sources or {}).items() if getattr(self, name) is not None}
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                for name in environment_variables(f.name):
                    raw = os.environ.get(name)
                    if raw is not None and raw.strip() != "":
                        setattr(self, f.name, raw)
                        self._given[f.name] = environment_variable(name)
                        break
        self._as_given = {name: getattr(self, name) for name in self._given}
        self._normalise()

    def setting_as_given(self, name: str) -> str:
        """The setting `name` as the user gave it, for a message about its value: "ROUNDPIPE_NUM_MICROBATCHES='8'",
        "`num_microbatches: 8` in the `roundpipe:` section of c.yaml", "roundpipe_num_microbatches=8 (a
        RoundPipeTrainingArguments field, ...)"; for a Python argument the field, its flag and its variable."""
        given = self._given.get(name)
        if given is None:
            return f"{knob(name)}={getattr(self, name)!r}"
        return given.written(self._as_given[name])

    def _written(self, name: str, value: Any) -> tuple[str, str]:
        """(`value` of setting `name` as written, where it was written; the SettingError source)."""
        given = self._given.get(name)
        return (f"{knob(name)}={value!r}" if given is None else given.written(value)), _source(given)

    def _normalise(self) -> None:
        """Every value to its final type, refused here when no engine could use it, naming the setting where it was
        given ([Note: settings checked where given])."""
        given = self._given
        if self.devices is not None:
            raw = self.devices
            self.devices = _device_list(raw, given.get("devices"))
            check_cuda_devices([torch.device(d) for d in self.devices], given.get("devices"), raw)
        for name, rule in NUMBER_RANGES.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, number_setting(value, name, rule, given.get(name)))
        for name in ("async_optimizer", "pin_memory", "summary", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, str_to_bool(value, *self._written(name, value)))
            elif value is not None and not isinstance(value, bool):
                if value not in (0, 1):
                    raise _refusal(name, value, "a boolean (true or false)", given.get(name))
                setattr(self, name, bool(value))
        if self.pin_memory and not torch.cuda.is_available():
            pin = given.get("pin_memory")
            if pin is None:
                raise SettingError("pin_memory (env ROUNDPIPE_PIN_MEMORY) is true, but page-locking host memory needs "
                                   "CUDA and this machine has none. Set pin_memory=False (--roundpipe_pin_memory "
                                   "false, ROUNDPIPE_PIN_MEMORY=0) or leave it unset.")
            raise SettingError(f"{pin.written(self._as_given['pin_memory'])} asks to page-lock host memory, which "
                               f"needs CUDA, and this machine has none. Set {pin.spell('false')} or leave it unset.",
                               _source(pin))
        for name in ("param_dtype", "optimizer_dtype"):
            setattr(self, name, to_dtype(getattr(self, name), *self._written(name, getattr(self, name))))
        for name, choices in (("recompute", RECOMPUTE_GRAINS), ("plan", PLAN_CHOICES), ("kernels", KERNEL_CHOICES),
                              ("optimizer_placement", PLACEMENT_CHOICES)):
            value = getattr(self, name)
            if value is not None:
                text = str(value).strip().lower()
                if text not in choices:
                    if name not in given:
                        raise SettingError(f"{knob(name)}={text!r}; choose one of {list(choices)}.")
                    raise SettingError(f"{given[name].written(value)}: choose one of {list(choices)}.",
                                       _source(given[name]))
                setattr(self, name, text)
        for name in ("forward_stages", "backward_stages"):
            setattr(self, name, _int_list(getattr(self, name), name, given.get(name)))
        if self.offload_dir is not None:
            self.offload_dir = _folder_setting(self.offload_dir, "offload_dir", given.get("offload_dir"))

    # Resolved values: what the engine actually uses, and the defaults the docs state (tests/test_docs_defaults.py).
    def resolved_devices(self) -> list[torch.device]:
        """The workers; named CUDA devices are checked against what this machine has (an engine asks once)."""
        if self.devices is not None:
            devices = [torch.device(d) for d in self.devices]
            check_cuda_devices(devices, self._given.get("devices"), self._as_given.get("devices"))
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
    def resolved_optimizer_placement(self) -> str:
        return self.optimizer_placement or "auto"

    @property
    def resolved_offload_dir(self) -> str:
        """`offload_dir`, else the user's cache folder's `roundpipe/offload` (`XDG_CACHE_HOME`, else `~/.cache`):
        a disk users expect to hold caches, never /tmp (often tmpfs, which is memory)."""
        if self.offload_dir is not None:
            return self.offload_dir
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(cache, "roundpipe", "offload")

    @property
    def resolved_recompute(self) -> str:
        return self.recompute or "stage"

    @property
    def resolved_wait_timeout_s(self) -> float:
        return 600.0 if self.wait_timeout_s is None else self.wait_timeout_s

    @property
    def resolved_async_warmup_steps(self) -> int:
        return 0 if self.async_warmup_steps is None else self.async_warmup_steps

    @property
    def resolved_kernels(self) -> str:
        return self.kernels or "auto"

    @property
    def resolved_head_shards(self) -> int | str:
        return 1 if self.head_shards is None else self.head_shards
