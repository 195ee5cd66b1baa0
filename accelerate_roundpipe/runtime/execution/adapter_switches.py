"""PEFT's adapter switches (`disable_adapter()`, `set_adapter(...)`) reaching the devices' copies of the layers.

[Note: adapter switches]
Each device runs its own copy of a layer ([Note: stateless layers], runtime/execution/layer_copy.py), deep-copied once
from the user's layer. PEFT switches adapters by setting plain attributes on its layer modules (`_disable_adapters`,
`_active_adapter`, `merged_adapters`): set on the user's modules, a copy made earlier never saw them, so
`with model.disable_adapter(): model(...)` (how TRL's DPO takes a PEFT policy's reference log-probabilities) still
ran the adapters: the output was silently the policy's. Before every pass the engine compares these attributes with
what the copies hold and, when one changed, waits for the passes in flight (which run on the old setting) and sets
the new values on every copy. A backward runs with the setting its forward ran with (`model(...)` in
`disable_adapter()`, backward after it: the recomputation must see what the forward saw), so the pass keeps the
setting it read. Two changes cannot be followed and are refused:
- a merged adapter (`merge_adapter()`): the merge rewrites the base weights outside the engine's host store;
- a training pass whose trainable parameters differ from the ones the engine was built with (`set_adapter` to
  another adapter, or training inside `disable_adapter()`): the engine's optimizer copies and gradient buffers were
  made for the parameters that required grad when it was built, so the switch would silently train the wrong ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

SWITCHES = ("_disable_adapters", "_active_adapter", "merged_adapters")


class AdapterSwitches:
    """The PEFT switches of the pipeline layers, and the values the devices' copies hold."""

    def __init__(self, layers: list[nn.Module], trainable: Callable[[nn.Parameter], bool]) -> None:
        # (layer index, module path, module) of every module that holds a switch: found once, read every pass.
        self.holders = [(index, path, module) for index, layer in enumerate(layers)
                        for path, module in layer.named_modules()
                        if any(name in vars(module) for name in SWITCHES)]
        # Whether each parameter had an optimizer copy when the engine was built (only read with adapters around).
        self._params = [(name, p, trainable(p)) for layer in layers for name, p in layer.named_parameters()] \
            if self.holders else []
        self.shown = self.read()

    def read(self) -> tuple:
        """The switches now, as values (lists as tuples: comparable with, and restorable from, a later reading;
        read before every pass, so nothing is copied deeper than that)."""
        return tuple(tuple(_frozen(vars(module).get(name)) for name in SWITCHES) for _, _, module in self.holders)

    def check(self, training: bool) -> tuple:
        """Refuse what cannot be followed ([Note: adapter switches]); returns the setting the pass runs with."""
        if not self.holders:
            return ()
        now = self.read()
        for (_, path, _), values in zip(self.holders, now):
            merged = values[SWITCHES.index("merged_adapters")]
            if merged:
                raise ValueError(f"the adapter(s) {list(merged)} are merged into {path or 'a layer'} "
                                 f"(merge_adapter(), or merge_and_unload() while RoundPipe runs the model): the "
                                 f"merge rewrote the base weights outside RoundPipe's host store, so the engine "
                                 f"cannot run this model any more. After merge_adapter(), unmerge them "
                                 f"(unmerge_adapter()); after merge_and_unload(), use the merged model as a plain "
                                 f"model (close the engine first: engine.close(), a Trainer's "
                                 f"trainer.roundpipe_engine.close()), or wrap it again (evaluate or train before "
                                 f"merging). To train a merged model, merge_and_unload() it before handing it to "
                                 f"RoundPipe.")
        if training:
            changed = [name for name, p, was in self._params if p.requires_grad != was]
            if changed:
                raise ValueError(f"the parameters that require grad changed since the RoundPipe engine was built "
                                 f"({len(changed)} of them, e.g. {changed[0]}): a set_adapter(...) to another adapter, "
                                 f"or training inside disable_adapter(). The engine keeps optimizer state and "
                                 f"gradients only for the parameters that required grad when it was built, so it "
                                 f"would train the wrong ones. Switch adapters back before training, or build the "
                                 f"engine (prepare the model) after choosing the adapter to train.")
        return now

    def needs(self, setting: tuple) -> bool:
        """Whether the copies hold another setting than `setting` (a `check` reading)."""
        return bool(self.holders) and setting != self.shown

    def show(self, setting: tuple, copies: Iterable[tuple[int, nn.Module]]) -> None:
        """Set `setting` on the layer copies (`(layer index, copy module)`); the caller made sure no pass is running
        on them. Copies made later are deep-copied from the user's layers, so they get what those hold then."""
        by_layer: dict[int, list[tuple[str, tuple]]] = {}
        for (index, path, _), values in zip(self.holders, setting):
            by_layer.setdefault(index, []).append((path, values))
        for index, copy_module in copies:
            for path, values in by_layer.get(index, []):
                target = copy_module.get_submodule(path)
                for name, value in zip(SWITCHES, values):
                    if name in vars(target):
                        setattr(target, name, list(value) if isinstance(value, tuple) else value)
        self.shown = setting


def _frozen(value):
    """PEFT keeps adapter names as a str or a list of str, and merged adapters as a list: lists become tuples."""
    return tuple(value) if isinstance(value, list) else value
