"""The reaches into the user's model object: its methods patched per instance, transformers' and PEFT's
`save_pretrained`, transformers' PEFT-adapter flag, the loss function its forward calls and a forward of its class's
own ([Note: compatibility reaches]). Written against torch 2.13, transformers 5.24 and peft 0.21."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from . import LibraryChangedError, mentions, require_attribute, require_mention, require_parameters


def patch_methods(model: nn.Module, methods: Mapping[str, Callable]) -> dict[str, Callable | None]:
    """Give `model` (the user's object) its own `name` methods, for this instance only: `nn.Module.__setattr__`
    stores a plain callable in the instance `__dict__`, where attribute lookup finds it before the class's method
    (torch 2.13; PEFT's `PeftModel` forwards only attributes it lacks). Returns what the instance held before (None:
    nothing, the class's method was used), for `restore_methods`. Each method is read back: a `__setattr__` that
    stored it elsewhere would leave the user's calls going around RoundPipe."""
    originals = {name: model.__dict__.get(name) for name in methods}
    for name, method in methods.items():
        setattr(model, name, method)
        if model.__dict__.get(name) is not method or getattr(model, name) is not method:
            raise LibraryChangedError("torch", f"{type(model).__name__}.{name}, patched on the instance",
                                      "setting it on the instance no longer makes the instance's calls use it")
    return originals


def restore_methods(model: nn.Module, originals: Mapping[str, Callable | None]) -> None:
    """Undo `patch_methods`: the instance gets back what it held (or the class's method again)."""
    for name, original in originals.items():
        if original is None:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = original


def class_method(model: nn.Module, name: str) -> Callable:
    """The class's own `name` method bound to `model`, bypassing the instance's patched one (the patched
    `generate` calls it). transformers 5.24: causal LMs get `generate` from `GenerationMixin`."""
    method = getattr(type(model), name, None)
    if method is None:
        raise LibraryChangedError("transformers", f"{type(model).__name__}.{name}",
                                  f"the model's class has no `{name}`")
    return method.__get__(model)


def check_zero_grad_replacement() -> None:
    """The patched `model.zero_grad(set_to_none=...)` takes what `nn.Module.zero_grad` takes (torch 2.13)."""
    require_parameters(nn.Module.zero_grad, ("set_to_none",), "torch", "nn.Module.zero_grad (patched on the model)")


@dataclass
class SavePretrainedCall:
    """What a call of a model's `save_pretrained(*args, **kwargs)` asks for, whatever the class's parameter order
    (transformers: `save_directory, is_main_process, state_dict, ...`; PEFT: `save_directory, safe_serialization,
    selected_adapters, save_embedding_layers, is_main_process, ...` with `state_dict` through `**kwargs`)."""

    save_directory: object
    is_main_process: bool
    gives_state_dict: bool  # the caller passed a state dict of its own (not None)
    state_dict_positional: bool  # ... positionally: then it cannot be replaced by keyword


def save_pretrained_call(model: nn.Module, args: tuple, kwargs: dict) -> SavePretrainedCall:
    """Read a `save_pretrained` call against the signature of `type(model).save_pretrained`. Checked: it takes
    `save_directory` and `is_main_process`, and a `state_dict` (as a parameter, or through `**kwargs`, which
    PEFT 0.21 reads it from); transformers 5.24 and peft 0.21."""
    library = "peft" if type(model).__module__.startswith("peft") else "transformers"
    method = type(model).save_pretrained
    reach = f"{type(model).__qualname__}.save_pretrained (patched on the model)"
    require_parameters(method, ("save_directory", "is_main_process", "state_dict"), library, reach, leading=False,
                       or_var_keyword=("state_dict",))
    try:
        bound = inspect.signature(method).bind(model, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{reach}: {error}") from None
    arguments = dict(bound.arguments)
    extra = next((arguments.pop(p.name) for p in inspect.signature(method).parameters.values()
                  if p.kind is inspect.Parameter.VAR_KEYWORD and p.name in arguments), {})
    positional = "state_dict" in arguments and "state_dict" not in kwargs
    state_dict = arguments.get("state_dict", extra.get("state_dict"))
    return SavePretrainedCall(save_directory=arguments.get("save_directory"),
                              is_main_process=arguments.get("is_main_process", True),
                              gives_state_dict=state_dict is not None, state_dict_positional=positional)


def has_transformers_adapters(model: nn.Module) -> bool:
    """Whether PEFT adapters were loaded into a transformers model through transformers' own integration
    (`model.load_adapter`): its `_hf_peft_config_loaded` flag, which `save_pretrained` reads to write the adapter
    only (transformers 5.24)."""
    from transformers import PreTrainedModel

    require_mention(PreTrainedModel.save_pretrained, "_hf_peft_config_loaded", "transformers",
                    "PreTrainedModel._hf_peft_config_loaded (adapters loaded through transformers)")
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def own_loss_function(causal_lm: nn.Module) -> Callable | None:
    """The function the model's own forward computes its `loss` with, when it is not transformers' plain causal-LM
    loss (`ForCausalLMLoss`, which the pipeline's head computes fused): a `model.loss_function = fn` of the user's,
    a `model.loss_type` naming another `LOSS_MAPPING` entry, a replaced `LOSS_MAPPING["ForCausalLM"]`, a subclass's
    own `loss_function` ([Note: the model's own loss function] in `models/causal_lm.py`). None when it is that plain
    loss, and when the class's forward does not call `self.loss_function` at all: then nothing set there changes
    HF's loss either. transformers 5.24: `PreTrainedModel.loss_function` is a property giving `_loss_function` when
    set, else `LOSS_MAPPING[loss_type]`; the forward is read once per class ([Note: compat checks run once])."""
    forward = getattr(type(causal_lm), "forward", None)
    if forward is None or not mentions(forward, "loss_function"):
        return None
    loss_function = getattr(causal_lm, "loss_function", None)
    if loss_function is None:
        return None
    return None if loss_function is _plain_causal_lm_loss() else loss_function


def _plain_causal_lm_loss() -> Callable:
    """`transformers.loss.loss_utils.ForCausalLMLoss` (transformers 5.24 and 4.57), the loss the head computes."""
    import importlib

    module = importlib.import_module("transformers.loss.loss_utils")
    return require_attribute(module, "ForCausalLMLoss", "transformers", "transformers.loss.loss_utils.ForCausalLMLoss "
                             "(the causal-LM loss RoundPipe's head computes fused)")


def forward_override(causal_lm: nn.Module) -> str | None:
    """Where the model's class overrides the forward of the transformers class it derives from
    ("`pkg.ZLossLlama.forward` overrides `LlamaForCausalLM.forward`"), else None: a forward defined outside the
    `transformers` package below a transformers class that has its own. The engine runs the decoder layers and the
    loss itself and never calls it, so what it changes would be lost ([Note: the model's own loss function]). A
    class-level patch of the transformers class itself (Liger's) is that class's forward, not an override; remote
    code (`transformers_modules.*`) deriving from no transformers causal LM is the family's own forward."""
    owners = [cls for cls in type(causal_lm).__mro__ if "forward" in vars(cls)]
    if not owners or owners[0].__module__.startswith("transformers."):
        return None
    library = next((cls for cls in owners[1:] if cls.__module__.startswith("transformers.")), None)
    if library is None:
        return None
    own = owners[0]
    return f"`{own.__module__}.{own.__qualname__}.forward` overrides `{library.__qualname__}.forward`"
