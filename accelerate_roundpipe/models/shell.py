"""Ask a model's own forward what it would pass to one decoder layer, without running any decoder layer.

[Note: shells]
Masks (causal, padding, sliding window, chunked, packed sequences), rotary embeddings (one per layer type in
Gemma3), position and cache ids, embedding scaling and the other keyword arguments a decoder layer receives are
computed by the inner model's forward, and that code changes between transformers versions and families. Rather
than re-implementing it, each pipeline layer keeps a *shell*: a shallow copy of the inner model whose decoder
layers are replaced by `_LayerStub`s and which keeps only the submodules the layer needs (the rotary embedding;
the embedding table in the first layer). Calling the shell runs the model's own code up to the decoder layer we
want; that stub raises `_LayerCallCaptured` with the exact positional and keyword arguments, and the real layer is
then called with them. The shell holds no decoder layer, no final norm and no reference to the full model.

Limits: the arguments may not depend on what earlier decoder layers returned (stubs before the target return a
placeholder, see `_LayerStub.__call__`), and per-layer choices must come from the layer index or from plain
attributes of the layer (e.g. `attention_type`), which the stubs copy.
"""

from __future__ import annotations

import contextvars
import copy
import types

from torch import nn

_target_layer_index: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "roundpipe_target_layer_index", default=None
)

PLAIN_ATTRIBUTE_TYPES = (str, int, float, bool, type(None))


class _LayerCallCaptured(Exception):
    """Raised by the target stub to stop the shell's forward and hand back the decoder layer's arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("decoder layer call captured")
        self.args_ = args
        self.kwargs_ = kwargs


class _LayerStub:
    """Stands in for decoder layer `layer_index` inside a shell (a plain object, so it costs no module machinery)."""

    def __init__(self, layer_index: int, layer: nn.Module):
        # Per-layer choices in model code read plain attributes such as `attention_type` or `layer_idx`.
        attributes = {k: v for k, v in vars(layer).items() if isinstance(v, PLAIN_ATTRIBUTE_TYPES)}
        self.__dict__.update(attributes)
        self.stub_layer_index = layer_index

    def __call__(self, *args, **kwargs):
        if _target_layer_index.get() == self.stub_layer_index:
            raise _LayerCallCaptured(args, kwargs)
        # An earlier layer: its output is not used (we stop at the target), but the model's loop must go on. Some
        # models keep `out` as the hidden state, older ones take `out[0]`; a leading axis of size 1 suits both.
        return args[0].unsqueeze(0) if args else kwargs["hidden_states"].unsqueeze(0)


class UnusedPart:
    """Placeholder for a part of the inner model that this shell must never reach (a clear error if it does)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"The model's forward used `{self.name}` before reaching the decoder layer it was asked for; "
            "this model cannot be split by `split_causal_lm` (see [Note: shells])."
        )


def make_shell(module: nn.Module, children: dict[str, nn.Module], plain: dict[str, object]) -> nn.Module:
    """A shallow copy of `module` whose only submodules are `children`, with `plain` set as ordinary attributes.

    The copy shares config and other attributes with `module` but has its own (empty) hook tables, so hooks put on
    the original (e.g. by accelerate's device dispatch) do not fire inside a pipeline layer, and vice versa.
    """
    shell = copy.copy(module)
    shell._parameters = {}
    shell._buffers = dict(module._buffers)
    shell._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    shell._modules = dict(children)
    for key, value in list(vars(shell).items()):
        if "hooks" in key and isinstance(value, dict):
            setattr(shell, key, type(value)())
        elif isinstance(value, types.MethodType) and value.__self__ is module:
            # A method patched onto the instance (TRL's fused LM head on `forward`, accelerate's fp32 output
            # wrapper) is bound to the original model: the shell would run the whole model through it, and a
            # device's deep copy of the layer would copy the model and whatever holds it (threads, locks).
            del shell.__dict__[key]
    for key, value in plain.items():
        shell.__dict__[key] = value
    return shell


def decoder_stubs(decoder_layers: nn.ModuleList) -> list[_LayerStub]:
    return [_LayerStub(index, layer) for index, layer in enumerate(decoder_layers)]


def capture_layer_call(shell: nn.Module, layer_index: int, **inputs) -> tuple[tuple, dict]:
    """Run `shell` (see [Note: shells]) until it calls decoder layer `layer_index`; return that call's args, kwargs."""
    token = _target_layer_index.set(layer_index)
    try:
        shell(**inputs)
    except _LayerCallCaptured as captured:
        return captured.args_, captured.kwargs_
    finally:
        _target_layer_index.reset(token)
    raise RuntimeError(
        f"{type(shell).__name__}.forward returned without calling decoder layer {layer_index}; "
        "this model cannot be split by `split_causal_lm` (see [Note: shells])."
    )
