"""A device's own lightweight copy of a layer: module structure and buffers, parameters bound per task.

Several workers may run the same layer at once, so nothing ever binds weights into the user's module. Each device
deep-copies a layer once, without its parameters, and binds the tensors it uploaded into its own copy before use.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .host_store import Binding


class StatefulLayerError(RuntimeError):
    pass


class LayerCopy:
    def __init__(self, layer: nn.Module, layer_index: int, bindings: list[Binding], device: torch.device) -> None:
        memo = {id(p): None for _, p in layer.named_parameters(remove_duplicate=False)}
        self.module = copy.deepcopy(layer, memo).to(device)
        self.layer_index = layer_index
        self.kind = type(layer).__name__
        modules = dict(self.module.named_modules(remove_duplicate=False))
        self._targets = [(modules[b.module_path], b.attr, b.bucket_index, b.slot_index) for b in bindings]
        self._buffers = [(name, buf) for name, buf in self.module.named_buffers(remove_duplicate=False)]

    def bind(self, views: dict[int, list[torch.Tensor]]) -> None:
        """Point every parameter use at the uploaded tensors (`views[bucket][slot]`)."""
        for module, attr, bucket_index, slot_index in self._targets:
            module._parameters[attr] = views[bucket_index][slot_index]

    def unbind(self) -> None:
        """Drop the task's tensors: a bound view keeps its whole uploaded flat (and, through `.grad`, its gradient
        buffer) alive on the device, so a copy left bound after its task would hold every layer's parameters and
        gradients on the GPU at once (on a 24 GiB card that was the difference between fitting and not)."""
        for module, attr, _, _ in self._targets:
            module._parameters[attr] = None

    def set_training(self, training: bool) -> None:
        if self.module.training != training:
            self.module.train(training)

    def buffer_versions(self) -> list[int]:
        return [buf._version for _, buf in self._buffers]

    def check_stateless(self, before: list[int]) -> None:
        changed = [name for (name, buf), version in zip(self._buffers, before) if buf._version != version]
        if changed:
            raise StatefulLayerError(
                f"layer {self.layer_index} ({self.kind}) changed its buffers {changed} in forward. RoundPipe runs "
                f"layers on stateless workers and recomputes them, so a layer may not keep state (e.g. BatchNorm "
                f"running statistics): call .eval() on it, use a stateless variant (LayerNorm, GroupNorm), or set "
                f"track_running_stats=False.")
