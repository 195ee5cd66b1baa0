"""The reaches of `RoundPipeAccelerator` into `accelerate.Accelerator` and accelerate's state
([Note: compatibility reaches]). Written against accelerate 1.15."""

from __future__ import annotations

from . import LibraryChangedError, check_overrides, require_attribute, require_mention, require_parameters

LIBRARY = "accelerate"

# Every method of `accelerate.Accelerator` that `RoundPipeAccelerator` overrides, with the parameters it passes on
# positionally, in order (None: existence only).
ACCELERATOR_OVERRIDES: dict[str, tuple[str, ...] | None] = {
    "device": None,
    "prepare": None,
    "prepare_model": ("model", "device_placement", "evaluation_mode"),
    "prepare_optimizer": ("optimizer", "device_placement"),
    "prepare_data_loader": ("data_loader", "device_placement", "slice_fn_for_dispatch"),
    "backward": ("loss",),
    "gather": ("tensor",),
    "reduce": ("tensor", "reduction", "scale"),
    "pad_across_processes": ("tensor", "dim", "pad_index", "pad_first"),
    "clip_grad_norm_": ("parameters", "max_norm", "norm_type"),
    "clip_grad_value_": ("parameters", "clip_value"),
    "unwrap_model": ("model", "keep_fp32_wrapper", "keep_torch_compile"),
    "get_state_dict": ("model", "unwrap"),
    "end_training": (),
    "free_memory": (),
    "save_state": ("output_dir", "safe_serialization"),
    "load_state": ("input_dir", "load_kwargs"),
}


def original_accelerator() -> type:
    """accelerate's own `Accelerator` class, also while the launcher has swapped `accelerate.Accelerator` for
    RoundPipe's (`launch/install.py`)."""
    import accelerate

    for cls in accelerate.Accelerator.__mro__:
        if cls.__module__ == "accelerate.accelerator" and cls.__qualname__ == "Accelerator":
            return cls
    raise LibraryChangedError(LIBRARY, "accelerate.Accelerator", "no class of that name in accelerate.accelerator")


def check_accelerator_overrides(cls: type, base: type) -> None:
    """`RoundPipeAccelerator`'s overrides of `accelerate.Accelerator` (`ACCELERATOR_OVERRIDES`) still override
    something, with the parameters it passes; its own helpers shadow nothing of accelerate's (accelerate 1.15)."""
    check_overrides(cls, base, ACCELERATOR_OVERRIDES, LIBRARY)


def _private_list(accelerator, name: str, used_by: str) -> list:
    reach = f"Accelerator.{name} (the list {used_by} works on)"
    value = getattr(accelerator, name, None)
    if not isinstance(value, list):
        raise LibraryChangedError(LIBRARY, reach,
                                  f"the accelerator has no list `{name}` (found {type(value).__name__})")
    for method in (original_accelerator().save_state, original_accelerator().load_state):
        require_mention(method, name, LIBRARY, reach)
    return value


def prepared_models(accelerator) -> list:
    """The accelerator's private `_models` list, in place: `prepare_model` appends to it, and `save_state` /
    `load_state` save and load each entry by its position (accelerate 1.15). RoundPipe replaces its entries for one
    `load_state` (so weights load through the engine) and appends the models it prepares."""
    return _private_list(accelerator, "_models", "save_state/load_state")


def prepared_optimizers(accelerator) -> list:
    """The accelerator's private `_optimizers` list, in place: `save_state` / `load_state` write and read one file
    per entry (accelerate 1.15). RoundPipe empties it for one save or load when each rank has its own shard."""
    return _private_list(accelerator, "_optimizers", "save_state/load_state")


def _check_prepared_marker() -> None:
    reach = "the `_is_accelerate_prepared` marker accelerate sets on what it prepared"
    require_mention(original_accelerator().prepare, "_is_accelerate_prepared", LIBRARY, reach)


def check_models_loaded_through_load_state_dict() -> None:
    """accelerate's `load_state` loads each entry of `_models` through that object's own `load_state_dict` (as
    `model.load_state_dict(...)`, or `safetensors.torch.load_model(model, ...)`, which calls it): so an entry may be
    a stand-in that routes the weights elsewhere (`checkpoint.EngineWeights`: through the engine, refreshing the
    optimizer copies). accelerate 1.15: `accelerate.checkpointing.load_accelerator_state`."""
    import accelerate.checkpointing as checkpointing

    reach = "accelerate.checkpointing.load_accelerator_state, loading each prepared model by its load_state_dict"
    load = getattr(checkpointing, "load_accelerator_state", None)
    if load is None:
        raise LibraryChangedError(LIBRARY, reach, "accelerate.checkpointing has no `load_accelerator_state`")
    require_mention(load, "load_state_dict", LIBRARY, reach)
    require_mention(original_accelerator().load_state, "load_accelerator_state", LIBRARY, reach)


def mark_prepared(obj) -> None:
    """Set the marker by which `Accelerator.prepare` recognises an object it already prepared and passes it through
    (accelerate 1.15: `_is_accelerate_prepared`)."""
    _check_prepared_marker()
    obj._is_accelerate_prepared = True


def is_prepared(obj) -> bool:
    """Whether accelerate already prepared `obj` (see `mark_prepared`)."""
    _check_prepared_marker()
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def turn_off_autocast(accelerator) -> None:
    """Turn off the autocast accelerate wraps a prepared model's forward in for mixed precision: the flag
    `native_amp` that `prepare_model` and `autocast` read (accelerate 1.15). RoundPipe's workers are other threads,
    where that autocast would do nothing; they compute in the compute copies' dtype instead."""
    reach = "Accelerator.native_amp (whether prepare_model wraps the forward in autocast)"
    require_mention(original_accelerator().prepare_model, "native_amp", LIBRARY, reach)
    accelerator.native_amp = False


def dynamo_backend(accelerator):
    """The torch.compile backend accelerate was asked for (`DynamoBackend.NO` when none): the state's
    `dynamo_plugin`, which `AcceleratorState` sets (accelerate 1.15). RoundPipe refuses compilation, so a renamed
    attribute must not read as "no compilation"."""
    from accelerate.state import AcceleratorState

    reach = "AcceleratorState.dynamo_plugin (the torch.compile backend RoundPipe refuses)"
    require_mention(AcceleratorState.__init__, "dynamo_plugin", LIBRARY, reach)
    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    if plugin is None or not hasattr(plugin, "backend"):
        raise LibraryChangedError(LIBRARY, reach, "the accelerator's state has no `dynamo_plugin.backend`")
    return plugin.backend


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons (`AcceleratorState`, `PartialState`, `GradientState`), so that
    the next Accelerator is built from scratch; for tests that build several in one process. Their private
    `_reset_state` (accelerate 1.15)."""
    from accelerate.state import AcceleratorState, GradientState

    reach = "AcceleratorState._reset_state / GradientState._reset_state"
    for state in (AcceleratorState, GradientState):
        if not callable(getattr(state, "_reset_state", None)):
            raise LibraryChangedError(LIBRARY, reach, f"{state.__name__} has no `_reset_state` any more")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def check_accelerated_optimizer_init() -> None:
    """`accelerate.optimizer.AcceleratedOptimizer.__init__` still takes `(optimizer, device_placement, scaler)`:
    `RoundPipeAcceleratedOptimizer` subclasses it and calls `super().__init__(optimizer, device_placement=False,
    scaler=None)`, keeping the optimizer state on the host and loss scaling off (accelerate 1.15)."""
    from accelerate.optimizer import AcceleratedOptimizer

    require_parameters(AcceleratedOptimizer.__init__, ("optimizer", "device_placement", "scaler"), LIBRARY,
                       "accelerate.optimizer.AcceleratedOptimizer.__init__ (called by RoundPipeAcceleratedOptimizer)")


def state_backend(state) -> str | None:
    """The torch.distributed backend of accelerate's state (`PartialState.backend`, which `_prepare_backend` sets:
    "nccl", "gloo", ... or None on one process; accelerate 1.15), from which RoundPipe picks the device its
    collectives' tensors live on. A state without it must not read as "no backend"."""
    from accelerate.state import PartialState

    reach = "PartialState.backend (the backend accelerate's collectives run on)"
    require_mention(PartialState.__init__, "backend", LIBRARY, reach)
    return require_attribute(state, "backend", LIBRARY, reach)
