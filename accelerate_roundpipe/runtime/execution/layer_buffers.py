"""The buffers of the user's layers, changed after wrapping, reaching the devices' copies of the layers.

[Note: layer buffers followed]
Each device runs its own copy of a layer ([Note: stateless layers], runtime/execution/layer_copy.py), deep-copied once
from the user's layer with its buffers. A buffer the user changes afterwards (DeepSeek-V3's `e_score_correction_bias`,
which aux-loss-free load balancing updates between steps; a mask; any `register_buffer` value set in place or
reassigned) stayed as it was on the copies: the passes computed with the old value, silently (8.6e-2 off HF's logits
in the attack reproducer). Before every pass the engine reads each buffer of the user's layers (its identity and its
in-place version: cheap, and nothing but the user writes them, as the passes run on the copies) and, when one
changed, waits for the passes in flight (which run with the old value) and copies the new value into every copy. A
backward of `model(...)` recomputes with the buffers its forward saw, so it is refused when they changed in between,
as a changed weight is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class LayerBuffers:
    """The buffers of the pipeline layers, and the reading the devices' copies hold."""

    def __init__(self, layers: list[nn.Module]) -> None:
        # (layer index, module path, buffer name, owning module) of every buffer: found once, read every pass
        self.holders = [(index, path, name, module) for index, layer in enumerate(layers)
                        for path, module in layer.named_modules(remove_duplicate=False)
                        for name, buffer in module._buffers.items() if buffer is not None]
        self.shown = self.read()

    def read(self) -> tuple:
        """Each buffer's identity and in-place version now (comparable with an earlier reading)."""
        return tuple((id(buffer), buffer._version) if (buffer := module._buffers.get(name)) is not None else None
                     for _, _, name, module in self.holders)

    def needs(self, reading: tuple) -> bool:
        """Whether the copies hold other values than the user's layers at `reading`."""
        return reading != self.shown

    def show(self, reading: tuple, copies: Iterable[tuple[int, nn.Module]]) -> None:
        """Copy the changed buffers into the layer copies (`(layer index, copy module)`); the caller made sure no
        pass is running on them. Copies made later are deep-copied from the user's layers, so they get the values
        those hold then."""
        changed: dict[int, list[tuple[str, str, torch.Tensor | None]]] = {}
        for (index, path, name, module), now, was in zip(self.holders, reading, self.shown):
            if now != was:
                changed.setdefault(index, []).append((path, name, module._buffers.get(name)))
        for index, copy_module in copies:
            for path, name, value in changed.get(index, []):
                target = copy_module.get_submodule(path)
                held = target._buffers.get(name)
                if value is None or held is None or held.shape != value.shape or held.dtype != value.dtype:
                    target._buffers[name] = None if value is None else value.detach().to(
                        held.device if held is not None else value.device, copy=True)
                else:
                    held.copy_(value.detach())  # a blocking copy: done before the next pass reads it
        self.shown = reading
