"""A device's own lightweight copy of a layer: module structure and buffers, parameters bound per task.

Several workers may run the same layer at once, so nothing ever binds weights into the user's module. Each device
deep-copies a layer once, without its parameters, and binds the tensors it uploaded into its own copy before use.
PEFT's LoRA on bare parameters (MoE experts) is bound the same way, per call, on the copy:
[Note: LoRA on parameters in layer copies] in `compat/peft_internals.py`.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable

import torch
from torch import nn

from ...compat.peft_internals import make_param_wrappers_stateless
from ...compat.peft_linear import fuse_lora_adds
from ..state.host_store import Binding


class StatefulLayerError(RuntimeError):
    """A layer changed its own state (a buffer or a tensor attribute) in forward."""


class LayerState:
    """[Note: stateless layers]
    What a layer's forward may not change: every buffer (by identity and by in-place version) and every tensor held
    as a plain attribute, in each of its modules. Workers run a layer on their own copies and recompute it, so a
    change would stay on one device's copy (the user's module never sees it) and the recomputation would see another
    state than the forward did. In-place changes (BatchNorm's running statistics) bump a buffer's version;
    `self.count = self.count + 1` swaps the buffer for a new tensor; `self.cache = x` adds a tensor attribute: all
    three are caught by comparing this snapshot before and after a forward."""

    __slots__ = ("entries",)

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.entries = {}
        for path, module in modules:
            for name, buf in module._buffers.items():
                self.entries[("buffer", path, name)] = (buf, buf._version if buf is not None else 0)
            for name, value in vars(module).items():
                if isinstance(value, torch.Tensor):
                    self.entries[("attribute", path, name)] = (value, value._version)

    def changes(self, after: LayerState) -> list[str]:
        """What differs, as `buffer 'count' reassigned` / `attribute 'cache' set` phrases."""
        found = []
        for key in self.entries.keys() | after.entries.keys():
            kind, path, name = key
            where = f"{kind} {'.'.join(p for p in (path, name) if p)!r}"
            old, new = self.entries.get(key), after.entries.get(key)
            if old is None:
                found.append(f"{where} set")
            elif new is None:
                found.append(f"{where} deleted")
            elif old[0] is not new[0]:
                found.append(f"{where} reassigned")
            elif old[1] != new[1]:
                found.append(f"{where} changed in place")
        return sorted(found)


def _same_objects(before: list[tuple], after: list[tuple]) -> bool:
    """Whether each tuple of `after` holds exactly the objects (by identity) of its tuple in `before`."""
    return all(len(a) == len(b) and all(map(operator.is_, a, b)) for a, b in zip(before, after))


class LayerCopy:
    def __init__(self, layer: nn.Module, layer_index: int, bindings: list[Binding], device: torch.device) -> None:
        memo = {id(p): None for _, p in layer.named_parameters(remove_duplicate=False)}
        self.module = copy.deepcopy(layer, memo).to(device)
        make_param_wrappers_stateless(self.module)  # on this copy only, before its state is taken
        fuse_lora_adds(self.module)  # [Note: LoRA added in the GEMM], on this copy only
        self.layer_index = layer_index
        self.kind = type(layer).__name__
        modules = dict(self.module.named_modules(remove_duplicate=False))
        self._targets = [(modules[b.module_path], b.attr, b) for b in bindings]
        self._slots = [(module._parameters, attr) for module, attr, _ in self._targets]  # where `bind_tensors` puts
        self._modules = list(self.module.named_modules(remove_duplicate=False))
        self._dicts = [vars(module) for _, module in self._modules]
        self._buffer_dicts = [module._buffers for _, module in self._modules]
        self._check_from_now()  # `_checked`: the state every run so far was checked against

    def bind(self, tensor_for: Callable[[Binding], torch.Tensor]) -> None:
        """Point every parameter use at its uploaded tensor (`tensor_for(binding)`)."""
        self.bind_tensors([tensor_for(binding) for _, _, binding in self._targets])

    def bind_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Point the parameter uses at `tensors`, one per binding in the order of the bindings this copy was made
        with ([Note: bind plans])."""
        for (parameters, attr), tensor in zip(self._slots, tensors, strict=True):
            parameters[attr] = tensor

    def unbind(self) -> None:
        """Drop the task's tensors: a bound view keeps its whole uploaded flat (and, through `.grad`, its gradient
        buffer) alive on the device, so a copy left bound after its task would hold every layer's parameters and
        gradients on the GPU at once (on a 24 GiB card that was the difference between fitting and not)."""
        for module, attr, _ in self._targets:
            module._parameters[attr] = None

    def set_training(self, training: bool) -> None:
        if self.module.training != training:
            self.module.train(training)
            # A module's own train() may change its tensors (a cache made on eval()): the engine's doing, between
            # runs, so the next run is checked from here ([Note: stateless layers]), as it was before the snapshot.
            self._check_from_now()

    def _check_from_now(self) -> None:
        """Take the state now as the one the next runs are checked against."""
        self._checked = LayerState(self._modules)
        self._tensors = [tensor for tensor, _ in self._checked.entries.values() if tensor is not None]

    def state(self) -> tuple:
        """A cheap snapshot to check a run against ([Note: stateless layers]): the identity of every attribute and
        buffer of every module and the versions of the tensors among them. Taking the full `LayerState` (a scan of
        every module's attributes for tensors) before and after every layer run cost about 0.1 ms a layer, a few
        per cent of a small model's step; this one is C-speed tuple copies and stands for it: as long as nothing
        was replaced and no tensor's version moved, the layer's state is the one last checked in full."""
        return ([tuple(d.values()) for d in self._dicts], [tuple(b.values()) for b in self._buffer_dicts],
                [t._version for t in self._tensors])

    def check_stateless(self, before: tuple) -> None:
        """Raise if the forward just run changed the layer's state ([Note: stateless layers])."""
        after = self.state()
        if before[2] == after[2] and _same_objects(before[0], after[0]) and _same_objects(before[1], after[1]):
            return
        # Something was replaced (not necessarily a tensor: an int counter is no state of ours): the full check
        # against the state every earlier run was checked against, so the change is this run's.
        current = LayerState(self._modules)
        changed = self._checked.changes(current)
        self._checked = current
        self._tensors = [tensor for tensor, _ in current.entries.values() if tensor is not None]
        if changed:
            raise StatefulLayerError(
                f"layer {self.layer_index} ({self.kind}) changed its state in forward: {', '.join(changed)}. "
                f"RoundPipe runs layers on stateless workers and recomputes them, so a layer may not keep state "
                f"(buffers such as BatchNorm's running statistics, counters, tensors cached as attributes): the "
                f"change would never reach your module. Call .eval() on it, use a stateless variant (LayerNorm, "
                f"GroupNorm, track_running_stats=False), or compute the value outside the layer and pass it in.")
