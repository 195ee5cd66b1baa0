"""`RoundPipePlugin`: RoundPipe's settings in the shape of accelerate's FSDP/DeepSpeed plugins.

The plugin IS a `RoundPipeConfig` (same fields, help texts and `ROUNDPIPE_*` variables; `accelerate_roundpipe.config`
stays the one module that reads their values). What it adds is the plugin-side checking: a misspelt `ROUNDPIPE_*`
variable is an error rather than a silently ignored setting, and a bad value names where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass

from ..config import ENV_PREFIX, Given, RoundPipeConfig, SettingError, environment_variables

WHERE_SETTINGS_COME_FROM = ("(settings come from RoundPipePlugin(...) arguments, --roundpipe_* training arguments, the "
                            "`roundpipe:` section of the accelerate config, or ROUNDPIPE_* environment variables)")


def known_variables() -> list[str]:
    """Every `ROUNDPIPE_*` variable RoundPipe reads: one per `RoundPipeConfig` field, plus the aliases `ENV_ALIASES`
    gives a field."""
    return sorted(name for f in dataclasses.fields(RoundPipeConfig) for name in environment_variables(f.name))


def check_variable_names(environ: dict[str, str] | None = None) -> None:
    """Raise on a `ROUNDPIPE_*` variable that no field reads (a typo would otherwise be ignored silently).

    Only the names are looked at here; the values are read by `RoundPipeConfig`.
    """
    environ = os.environ if environ is None else environ
    known = known_variables()
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise SettingError(f"unknown RoundPipe environment variable(s): {', '.join(hints)}. RoundPipe reads only "
                       f"{', '.join(known)}; rename or unset the others.", "environment")


@dataclass(kw_only=True)
class RoundPipePlugin(RoundPipeConfig):
    """RoundPipe settings for `RoundPipeAccelerator(roundpipe_plugin=...)` and the launchers.

    Fields, help texts, defaults and `ROUNDPIPE_<FIELD>` variables are those of `RoundPipeConfig` (see its `Args:`;
    e.g. `devices`, `num_microbatches`, `async_optimizer`, `param_dtype`). `None` means "not said": the environment
    variable is used when set, else the documented default. An explicit argument beats the environment.

    Example::

        plugin = RoundPipePlugin(devices=["cuda:0", "cuda:1"], num_microbatches=8)
        accelerator = RoundPipeAccelerator(roundpipe_plugin=plugin, gradient_accumulation_steps=4)
    """

    def __post_init__(self, sources: dict[str, Given] | None = None) -> None:
        check_variable_names()
        try:
            super().__post_init__(sources)
        except SettingError as error:
            # The message says what and where; the frames below are the checks' own (from None: one message).
            if error.source == "given":  # the caller said where: a flag, a config file's key, a training argument
                raise
            # A variable (named as such), or a Python argument: where else settings come from.
            raise SettingError(f"invalid RoundPipe setting: {error} {WHERE_SETTINGS_COME_FROM}", error.source) from None
        except (ValueError, RuntimeError, TypeError) as error:  # not a check's refusal: keep the chain
            raise ValueError(f"invalid RoundPipe setting: {error} {WHERE_SETTINGS_COME_FROM}") from error
