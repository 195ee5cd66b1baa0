"""The reaches of `RoundPipeTrainer` into `transformers.Trainer` and `TrainingArguments`
([Note: compatibility reaches]). Written against transformers 5.24."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator

from . import (
    LibraryChangedError,
    check_overrides,
    mentions,
    require_attribute,
    require_mention,
    require_parameters,
)

LIBRARY = "transformers"

# Every method of `transformers.Trainer` that `RoundPipeTrainer` overrides, with the parameters it passes on to (or
# receives from) the base method positionally, in order; None: it passes `*args, **kwargs` through unchanged.
TRAINER_OVERRIDES: dict[str, tuple[str, ...] | None] = {
    "create_accelerator_and_postprocess": (),
    "_move_model_to_device": ("model", "device"),
    "_wrap_model": ("model", "training", "dataloader"),
    "_prepare_input": ("data",),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_maybe_log_save_evaluate": None,
    "log": ("logs",),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "prediction_step": ("model", "inputs", "prediction_loss_only"),
    "_get_grad_norm": ("model", "grad_norm"),
    "_get_output_dir": ("trial",),
    "_save_checkpoint": ("model", "trial"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
}


def check_trainer_overrides(cls: type, base: type) -> None:
    """`RoundPipeTrainer`'s overrides of `transformers.Trainer` (`TRAINER_OVERRIDES`) still override something, with
    the parameters it passes; its own helpers shadow nothing of the Trainer's. Written against transformers 5.24,
    where each of these methods exists with these parameters."""
    check_overrides(cls, base, TRAINER_OVERRIDES, LIBRARY)


def _trainer_module():
    return importlib.import_module("transformers.trainer")


def _own_class(module_name: str, name: str) -> type:
    """transformers' own class `<module_name>.<name>`, also while the launcher has swapped RoundPipe's subclass in
    under that name (`launch/install.py`): the class of that name defined in that module, along the MRO of what the
    module holds now. The checks below read the Trainer's code through it, not `transformers.Trainer`, which under
    the launcher is `RoundPipeTrainer`, whose own code mentions every name they look for."""
    reach = f"{module_name}.{name}"
    current = require_attribute(importlib.import_module(module_name), name, LIBRARY, reach)
    for cls in getattr(current, "__mro__", ()):
        if cls.__module__ == module_name and cls.__qualname__ == name:
            return cls
    raise LibraryChangedError(LIBRARY, reach, f"no class {name} defined in {module_name} behind {current!r}")


def original_trainer() -> type:
    """transformers' own `Trainer` (see `_own_class`)."""
    return _own_class("transformers.trainer", "Trainer")


def original_training_arguments() -> type:
    """transformers' own `TrainingArguments` (see `_own_class`)."""
    return _own_class("transformers.training_args", "TrainingArguments")


@contextlib.contextmanager
def trainer_module_name_swapped(name: str, replacement: object, used_by: Callable) -> Iterator[None]:
    """`transformers.trainer.<name>` is `replacement` for the block: the Trainer's method `used_by` looks the name
    up in its module's globals, so this changes what that one call builds or calls without copying its
    version-specific code. Used for `Accelerator` (in `create_accelerator_and_postprocess`, so that the Trainer
    builds a `RoundPipeAccelerator`) and `nested_gather` (in `_maybe_log_save_evaluate`, so that its all-gather is
    named when it fails). Checked: the module still has the name and `used_by` still looks it up (transformers
    5.24)."""
    module = _trainer_module()
    reach = f"transformers.trainer.{name}, swapped while Trainer.{used_by.__name__} runs"
    original = require_attribute(module, name, LIBRARY, reach)
    require_mention(used_by, name, LIBRARY, reach)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def trainer_module_original(name: str) -> object:
    """`transformers.trainer.<name>` as it is now (the function `trainer_module_name_swapped` wraps)."""
    return require_attribute(_trainer_module(), name, LIBRARY, f"transformers.trainer.{name}")


def limit_gpus_per_process(args, most: int) -> None:
    """`args.n_gpu` at most `most`: RoundPipe drives every GPU from one process, so the Trainer must neither wrap
    the model in `DataParallel` nor multiply the batch size by the GPU count. `TrainingArguments.n_gpu` is a
    read-only property over the private `_n_gpu` that `_setup_devices` fills (transformers 5.24); checked on the
    class, so that any `args` object (a subclass, a test's stand-in) is set the same way."""
    reach = "TrainingArguments._n_gpu (behind the n_gpu property)"
    n_gpu = inspect.getattr_static(original_training_arguments(), "n_gpu", None)
    if not isinstance(n_gpu, property) or not mentions(n_gpu.fget, "_n_gpu"):
        raise LibraryChangedError(LIBRARY, reach, "`TrainingArguments.n_gpu` is no longer a property reading `_n_gpu`")
    args._n_gpu = min(args.n_gpu, most)  # reading `n_gpu` first runs `_setup_devices`, which would overwrite it


def training_step_grad_scale(trainer, num_items_in_batch, base_training_step: Callable) -> float:
    """What `Trainer.training_step` (`base_training_step`) multiplies the loss's gradient by before `backward`:
    1 when the loss is already normalised for gradient accumulation (`loss_is_scaled_for_ga`, else when the model
    took `num_items_in_batch` or a `compute_loss_func` is set), else 1 / `current_gradient_accumulation_steps`. The
    fused step gives the engine this scale itself, so the rule is mirrored here (transformers 5.24); checked: the
    Trainer's step still reads each of these attributes (read once: [Note: compat checks run once])."""
    reach = "the gradient-accumulation scale of Trainer.training_step (mirrored by RoundPipe's fused step)"
    for name in ("model_accepts_loss_kwargs", "compute_loss_func", "current_gradient_accumulation_steps"):
        require_mention(base_training_step, name, LIBRARY, reach)
    # `loss_is_scaled_for_ga` is newer (read by 5.24, absent from 5.17, which the lent GPU has): the rule without it
    # is the older versions' whole rule.
    scaled_for_ga = getattr(trainer, "loss_is_scaled_for_ga", None) \
        if mentions(base_training_step, "loss_is_scaled_for_ga") else None
    if scaled_for_ga is None:
        scaled_for_ga = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
            trainer.compute_loss_func is not None
    return 1.0 if scaled_for_ga else 1.0 / trainer.current_gradient_accumulation_steps


def trainer_file_names() -> tuple[str, str, str]:
    """The names of the files a Trainer checkpoint holds: `TRAINER_STATE_NAME`, `OPTIMIZER_NAME`, `SCHEDULER_NAME`
    of `transformers.trainer` (transformers 5.24), which RoundPipe writes and reads per rank."""
    module = _trainer_module()
    return tuple(require_attribute(module, name, LIBRARY, f"transformers.trainer.{name}")
                 for name in ("TRAINER_STATE_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME"))


def rotate_checkpoints(output_dir: str, save_total_limit, best_model_checkpoint) -> None:
    """`transformers.trainer_utils.rotate_checkpoints` by modification time: the rotation the Trainer ran inside a
    staging directory ([Note: staged checkpoints]), redone in the run directory. Checked: it takes these keyword
    parameters (transformers 5.24)."""
    module = importlib.import_module("transformers.trainer_utils")
    reach = "transformers.trainer_utils.rotate_checkpoints"
    rotate = require_attribute(module, "rotate_checkpoints", LIBRARY, reach)
    require_parameters(rotate, ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"), LIBRARY,
                       reach, leading=False)
    rotate(output_dir=output_dir, save_total_limit=save_total_limit, best_model_checkpoint=best_model_checkpoint,
           use_mtime=True)


def compute_loss_process_factor(average_tokens_across_devices: bool, counts_items: bool, num_items_in_batch: object,
                                num_processes: int, tp_size: int = 1, n_gpu: int = 1) -> int:
    """The factor `transformers.Trainer.compute_loss` multiplies the loss by, to undo DDP's mean when the loss was
    normalised by the global token count ([Note: data-parallel loss scaling]): `num_processes // tp_size` (`n_gpu`
    with several GPUs per process) when `average_tokens_across_devices`, the model counts items
    (`counts_items`: `model_accepts_loss_kwargs or compute_loss_func`) and a count was given; else 1. Mirrored
    (transformers 5.24 and 5.17) so RoundPipe can take it off the engine's fused loss; checked: `compute_loss`
    still reads each of these (transformers' own, also under the launcher), read once
    ([Note: compat checks run once])."""
    compute_loss = original_trainer().compute_loss
    reach = "the num_processes factor of Trainer.compute_loss (taken off RoundPipe's fused loss)"
    for name in ("average_tokens_across_devices", "model_accepts_loss_kwargs", "compute_loss_func",
                 "num_processes", "n_gpu"):
        require_mention(compute_loss, name, LIBRARY, reach)
    # The tensor-parallel divisor: `get_tp_size()` in 5.24, `parallelism_config.tp_size` in 5.17 (the GPU
    # machine's); 1 under RoundPipe either way (it refuses parallelism configs).
    if not (mentions(compute_loss, "get_tp_size") or mentions(compute_loss, "tp_size")):
        raise LibraryChangedError(LIBRARY, reach, "Trainer.compute_loss no longer divides by the tensor-parallel "
                                                  "size (`get_tp_size` or `tp_size`)")
    if not (average_tokens_across_devices and counts_items and num_items_in_batch is not None):
        return 1
    return num_processes // tp_size if n_gpu <= 1 else n_gpu
