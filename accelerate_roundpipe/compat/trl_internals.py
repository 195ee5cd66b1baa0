"""The reaches into TRL: its trainer classes, and the closure of its fused LM head ([Note: compatibility reaches]).
Written against trl 1.16."""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable

from . import LibraryChangedError, closures_over, mentions, require_attribute

LIBRARY = "trl"


# The methods of RoundPipeTrainer a TRL trainer replaces without calling it, and why that is right (trl 1.16). Any
# other override of a RoundPipeTrainer method by a TRL class must call `super()`, else RoundPipe's is skipped.
REPLACED_WITHOUT_SUPER = {
    # Their losses are their own (preference / policy losses), never `Trainer.compute_loss`'s, so there is no
    # num_processes factor for RoundPipeTrainer.compute_loss to take off ([Note: data-parallel loss scaling]).
    ("DPOTrainer", "compute_loss"), ("KTOTrainer", "compute_loss"), ("GRPOTrainer", "compute_loss"),
    # Their evaluation calls their own `compute_loss`, which needs the logits (token accuracy, entropies, preference
    # log-probabilities): RoundPipeTrainer.prediction_step's loss-only shortcut ([Note: evaluation loss]) applies
    # only to `Trainer.compute_loss`, so it would not run under them anyway.
    ("SFTTrainer", "prediction_step"), ("DPOTrainer", "prediction_step"), ("KTOTrainer", "prediction_step"),
    ("GRPOTrainer", "prediction_step"),
}


def trl_trainer(name: str, trainer_base: type, roundpipe_trainer: type) -> type:
    """`trl.<name>` (`SFTTrainer`, ...), to put `roundpipe_trainer` under by multiple inheritance
    (`class RoundPipeSFTTrainer(SFTTrainer, RoundPipeTrainer)`): TRL's classes come first, so each method of
    `roundpipe_trainer` they also define runs only through their `super()`. Checked (trl 1.16): the class is a
    subclass of `transformers.Trainer` (`trainer_base`), and every such method calls `super()` or is listed in
    `REPLACED_WITHOUT_SUPER`."""
    trl = importlib.import_module("trl")
    base = require_attribute(trl, name, LIBRARY, f"trl.{name}")
    if not (isinstance(base, type) and issubclass(base, trainer_base)):
        raise LibraryChangedError(LIBRARY, f"trl.{name}", "it is no longer a subclass of transformers.Trainer")
    ours = [n for n in vars(roundpipe_trainer) if not n.startswith("__")]
    for cls in base.__mro__:
        if cls is roundpipe_trainer or cls is trainer_base:
            break
        for method in ours:
            function = vars(cls).get(method)
            if callable(function) and not mentions(function, "super") and (name, method) not in \
                    REPLACED_WITHOUT_SUPER:
                raise LibraryChangedError(LIBRARY, f"trl.{cls.__qualname__}.{method}",
                                          f"it no longer calls super(), so {roundpipe_trainer.__qualname__}.{method} "
                                          f"would never run under trl.{name}")
    return base


def fused_output_class() -> type:
    """`trl.trainer.utils.FusedCausalLMOutput`: what TRL's fused LM head returns, and so what the RoundPipe model
    returns for `model(..., fused_lm_head=True)` (trl 1.16)."""
    utils = importlib.import_module("trl.trainer.utils")
    return require_attribute(utils, "FusedCausalLMOutput", LIBRARY, "trl.trainer.utils.FusedCausalLMOutput")


def fused_forward_code() -> types.CodeType:
    """The code of the forward `trl.trainer.utils.add_fused_lm_head` patches onto a model: the function nested in it
    (trl 1.16: `_fused_forward`, closing over the head's settings, `temperature` among them). Read once per
    `add_fused_lm_head` ([Note: compat checks run once]): `fused_head_setting` asks on every fused forward."""
    utils = importlib.import_module("trl.trainer.utils")
    reach = "the forward trl.trainer.utils.add_fused_lm_head patches in (its closure's `temperature`)"
    add_head = require_attribute(utils, "add_fused_lm_head", LIBRARY, reach)
    nested = closures_over(add_head, "temperature")
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
        # A function of that code has a closure: Python builds none without one cell per free variable.
        if name not in code.co_freevars:
            raise LibraryChangedError(LIBRARY, f"the `{name}` add_fused_lm_head closes over",
                                      f"the forward it patches in no longer closes over `{name}`")
        return function.__closure__[code.co_freevars.index(name)].cell_contents
    return default
