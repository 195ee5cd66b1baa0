"""The reaches into TRL: its trainer classes, and the closure of its fused LM head ([Note: compatibility reaches]).
Written against trl 1.16."""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable

from . import LibraryChangedError, require_attribute

LIBRARY = "trl"


def trl_trainer(name: str, trainer_base: type) -> type:
    """`trl.<name>` (`SFTTrainer`, ...), checked to be a subclass of `transformers.Trainer` (`trainer_base`): RoundPipe
    puts its Trainer under TRL's by multiple inheritance (trl 1.16)."""
    trl = importlib.import_module("trl")
    base = require_attribute(trl, name, LIBRARY, f"trl.{name}")
    if not (isinstance(base, type) and issubclass(base, trainer_base)):
        raise LibraryChangedError(LIBRARY, f"trl.{name}", "it is no longer a subclass of transformers.Trainer")
    return base


def fused_output_class() -> type:
    """`trl.trainer.utils.FusedCausalLMOutput`: what TRL's fused LM head returns, and so what the RoundPipe model
    returns for `model(..., fused_lm_head=True)` (trl 1.16)."""
    utils = importlib.import_module("trl.trainer.utils")
    return require_attribute(utils, "FusedCausalLMOutput", LIBRARY, "trl.trainer.utils.FusedCausalLMOutput")


def fused_forward_code() -> types.CodeType:
    """The code of the forward `trl.trainer.utils.add_fused_lm_head` patches onto a model: the function nested in it
    (trl 1.16: `_fused_forward`, closing over the head's settings, `temperature` among them)."""
    utils = importlib.import_module("trl.trainer.utils")
    reach = "the forward trl.trainer.utils.add_fused_lm_head patches in (its closure's `temperature`)"
    add_head = require_attribute(utils, "add_fused_lm_head", LIBRARY, reach)
    nested = [c for c in add_head.__code__.co_consts
              if isinstance(c, types.CodeType) and "temperature" in c.co_freevars]
    if len(nested) != 1:
        raise LibraryChangedError(LIBRARY, reach, f"add_fused_lm_head defines {len(nested)} function(s) closing "
                                                  f"over `temperature`, not one")
    return nested[0]


def fused_head_setting(model, own_forward: Callable | None, name: str, default):
    """A setting `add_fused_lm_head` closed over (its `temperature`), read from the forward it patched onto the
    model; `default` when TRL patched none. `own_forward` is the model's instance forward from before RoundPipe
    patched its own in. For a PEFT model TRL patches the base model instead (trl 1.16:
    `add_fused_lm_head(model.get_base_model() if is_peft_model(model) else model, ...)`), whose forward RoundPipe
    leaves alone: that one is read too. TRL keeps the setting nowhere else, so a TRL forward without it raises."""
    candidates = [own_forward]
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        candidates.append(vars(get_base_model()).get("forward"))
    for forward in candidates:
        function = getattr(forward, "__func__", forward)
        code = getattr(function, "__code__", None)
        if code is None or code is not fused_forward_code():  # checks that TRL still patches in such a forward
            continue
        if name not in code.co_freevars or not function.__closure__:
            raise LibraryChangedError(LIBRARY, f"the `{name}` add_fused_lm_head closes over",
                                      f"the forward it patches in no longer closes over `{name}`")
        return function.__closure__[code.co_freevars.index(name)].cell_contents
    return default
