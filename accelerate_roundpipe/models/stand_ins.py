"""Parameter-free stand-ins for the parts of an inner model that run before or after its decoder layers.

[Note: parts around the decoder layers]
Besides the token embedding, many families give the inner model parameterised parts that run once, before the
first decoder layer (GPT-2's and OPT's learned position embeddings, Bloom's embedding LayerNorm, OPT's input
projection) or after the last one (the final norm, OPT's output projection). Which is which is read from the model's
own forward by `probe_part_order`: a shell with stub decoder layers (see [Note: shells]) runs once on a two-token
input and records the order of the calls. The parts before the layers go to the first pipeline layer, those after
them to the head (applied in the order they were called); a parameterised part used between decoder layers, or never
used, is refused. Parameter-free children run after the last layer go to the head as well (OLMo's final LayerNorm
has no weights; left out, the head skipped it and the logits were 0.98 relative off HF's): a second probe records
every child, and the shells keep such a part where it also runs before the layers (nanochat's one norm).

A decoder layer's shell still runs the model's code up to its layer, and that code calls the parts before the
layers (`hidden = inputs_embeds + self.wpe(position_ids)`). There they are `ShapeOnlyPart`s: the part is run on the
meta device and zeros of its output's shape and dtype are returned. That is exact because the shell's hidden state
is thrown away (the real one, from the previous pipeline layer, takes its place), so only the shapes matter; it
holds as long as the parts before the layers feed only the hidden state, not the other arguments of a decoder layer
(the parity tests over every supported family in `tests/models/test_decoder_catalog.py` check it). A stand-in also
shows the part's own attributes as its meta copy has them, for forwards that read them before the call (Llama 4
reads `embed_tokens.weight.device`); inputs moved to the meta device that way give zeros on the CPU.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from .shell import _LayerStub, make_shell


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers live on the meta device (no data is copied)."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


class ShapeOnlyPart:
    """Stands in for a part run before the decoder layers inside a decoder layer's shell: zeros of the shape and
    dtype the part returns, on the device of its input (see [Note: parts around the decoder layers]).

    A plain object, not a module: its meta copy is invisible to `parameters()` and to `.to(device)`.
    """

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.meta_module = meta_copy(module)

    def __getattr__(self, name: str):
        """The part's own attributes (its `weight`, say) as the meta copy has them: some forwards read them before
        calling the part (Llama 4: `self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))`)."""
        if name == "meta_module" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.meta_module, name)

    def __call__(self, *args, **kwargs):
        tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and not v.is_meta]
        device = tensors[0].device if tensors else torch.device("cpu")
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        with torch.no_grad():
            output = self.meta_module(*meta_args, **meta_kwargs)
        return tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=device) if _is_tensor(v) else v, output)


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


class _RecordingPart(ShapeOnlyPart):
    def __init__(self, name: str, module: nn.Module, calls: list[str]):
        super().__init__(name, module)
        self.calls = calls

    def __call__(self, *args, **kwargs):
        self.calls.append(self.name)
        if any(call.startswith("layer ") for call in self.calls):
            # After a decoder layer only the order is wanted: the part is not run, not even on meta tensors, where
            # a kernel of its own (Liger's Triton RMSNorm, say) is launched with null pointers and faults the GPU.
            # Stand in with zeros shaped like its first input (norms and projections at the end keep the rank).
            first = next(v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor))
            return torch.zeros_like(first)
        return super().__call__(*args, **kwargs)


class _RecordingStub(_LayerStub):
    """A stub that records its call and returns the hidden state as is (`unsqueezed=False`: models that keep the
    layer's output as the hidden state) or with a leading axis of 1 (`unsqueezed=True`: models that take `out[0]`)."""

    def __init__(self, layer_index: int, layer: nn.Module, calls: list[str], unsqueezed: bool):
        super().__init__(layer_index, layer)
        self.calls = calls
        self.unsqueezed = unsqueezed

    def __call__(self, *args, **kwargs):
        self.calls.append(f"layer {self.stub_layer_index}")
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden.unsqueeze(0) if self.unsqueezed else hidden


class ProbeFailed(RuntimeError):
    """The inner model's forward failed before it reached its first decoder layer."""


def probe_part_order(inner: nn.Module, layers_name: str, part_names: list[str]) -> list[str]:
    """The calls the inner model's forward makes, in order: each of `part_names` (its parameterised children) as
    its name, each decoder layer as "layer i" (see [Note: parts around the decoder layers]).

    The forward runs on a shell: stub decoder layers and meta stand-ins for the parts, so no weight is read. It runs
    with both kinds of stub output (`_RecordingStub`) and keeps the run that raised nothing, else the longest record
    (an error after the layers ends a record there); an error before the first decoder layer raises `ProbeFailed`.
    """
    records = []
    for unsqueezed in (False, True):
        calls, error = _probe_once(inner, layers_name, part_names, unsqueezed)
        if error is None:
            return calls
        records.append((calls, error))
    calls, error = max(records, key=lambda record: len(record[0]))
    if not any(call.startswith("layer ") for call in calls):
        raise ProbeFailed(f"{type(error).__name__}: {error}") from error
    return calls


def _probe_once(
    inner: nn.Module, layers_name: str, part_names: list[str], unsqueezed: bool
) -> tuple[list[str], Exception | None]:
    calls: list[str] = []
    layers = inner._modules[layers_name]
    stubs = [_RecordingStub(index, layer, calls, unsqueezed) for index, layer in enumerate(layers)]
    plain: dict[str, object] = {layers_name: stubs}
    plain.update({name: _RecordingPart(name, inner._modules[name], calls) for name in part_names})
    children = {
        name: child
        for name, child in inner.named_children()
        if name not in plain and next(child.parameters(), None) is None
    }
    shell = make_shell(inner, children, plain)
    with torch.no_grad():
        try:
            shell(input_ids=torch.zeros(1, 2, dtype=torch.int64), use_cache=False)
        except Exception as error:  # kept: the caller decides whether the record is still usable
            return calls, error
    return calls, None
