"""`RoundPipeTrainingArguments`: `transformers.TrainingArguments` plus one `roundpipe_<field>` per engine knob.

The `roundpipe_*` fields are generated from `RoundPipeConfig`'s fields, so a knob added to the engine appears here
(as a `--roundpipe_<field>` flag of `HfArgumentParser`, with the engine's help text) without a second list to keep
in sync. `None`, the default, defers to the `ROUNDPIPE_<FIELD>` environment variable, then to the engine default.
Lists (devices, stage sizes) are comma-separated strings and dtypes are names, as in the environment. The values
are checked when the arguments are built ([Note: settings checked where given]).
"""

from __future__ import annotations

import dataclasses
import typing

from transformers import TrainingArguments

from ..config import ENV_PREFIX, Given, RoundPipeConfig
from .plugin import RoundPipePlugin

PREFIX = "roundpipe_"


def _cli_type(engine_type: object) -> type:
    """The type `HfArgumentParser` parses for an engine field (Optional[...]: every field defaults to None)."""
    members = set(typing.get_args(engine_type)) - {type(None)} or {engine_type}
    for simple in (bool, int, float):
        if members == {simple}:
            return simple | None
    return str | None


def _roundpipe_fields() -> list[tuple[str, type, dataclasses.Field]]:
    hints = typing.get_type_hints(RoundPipeConfig)
    out = []
    for f in dataclasses.fields(RoundPipeConfig):
        help_text = f"RoundPipe: {f.metadata.get('help', '')} (env {ENV_PREFIX}{f.name.upper()})"
        out.append((PREFIX + f.name, _cli_type(hints[f.name]), dataclasses.field(default=None,
                                                                                   metadata={"help": help_text})))
    return out


def _docstring() -> str:
    lines = ["`TrainingArguments` with RoundPipe's settings.", "", "Args:"]
    for f in dataclasses.fields(RoundPipeConfig):
        lines.append(f"    {PREFIX}{f.name} (env `{ENV_PREFIX}{f.name.upper()}`): {f.metadata.get('help', '')}")
    lines += ["", "A single process drives every device: `n_gpu` is at most 1 (no `DataParallel`, batch sizes are not",
              "multiplied) and the model is never moved to a GPU (`place_model_on_device` is False)."]
    return "\n".join(lines)


def _place_model_on_device(self) -> bool:
    return False  # the weights live in RoundPipe's host store


def _check_then_post_init(self) -> None:
    """The RoundPipe settings are checked here, where they are given ([Note: settings checked where given]): a
    script that builds its arguments first fails before it loads or tokenizes anything, not inside `train()`."""
    plugin_from_training_args(self)  # a refusal names the field (or the variable) it was given as
    TrainingArguments.__post_init__(self)


RoundPipeTrainingArguments = dataclasses.make_dataclass(
    "RoundPipeTrainingArguments", _roundpipe_fields(), bases=(TrainingArguments,),
    namespace={"place_model_on_device": property(_place_model_on_device), "__post_init__": _check_then_post_init,
               "__doc__": _docstring()})
RoundPipeTrainingArguments.__module__ = __name__  # pickled into checkpoints (training_args.bin) by this name


def field_given(name: str) -> Given:
    """A `roundpipe_<name>` field as a refusal names it: set in code or by a script's `--roundpipe_<name>` flag
    (`HfArgumentParser`), which cannot be told apart here."""
    return Given(f"{PREFIX}{name}={{value!r}}", f" (a RoundPipeTrainingArguments field, --{PREFIX}{name})",
                 fix_spelling=f"{PREFIX}{name}={{value!r}} or --{PREFIX}{name} {{value}}")


def plugin_from_training_args(args: TrainingArguments) -> RoundPipePlugin:
    """The RoundPipe settings of a run: `roundpipe_*` arguments where given (any `TrainingArguments` subclass may
    carry them), the `ROUNDPIPE_*` environment otherwise. The plugin knows which came from where (its
    `setting_as_given`), and a refusal names the field or the variable (a `SettingError`)."""
    values = {f.name: getattr(args, PREFIX + f.name, None) for f in dataclasses.fields(RoundPipeConfig)}
    return RoundPipePlugin(**values, sources={name: field_given(name) for name, value in values.items()
                                              if value is not None})
