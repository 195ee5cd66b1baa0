"""The `roundpipe:` section of an accelerate config file.

accelerate refuses unknown config keys, so RoundPipe's settings ride in a section that `accelerate-roundpipe launch`
strips before handing the file to accelerate. The section turns into the `ROUNDPIPE_*` variables the launched
process reads:

    roundpipe:
      enabled: true            # RoundPipe on (as `--roundpipe` does)
      devices: cuda:0,cuda:1   # -> ROUNDPIPE_DEVICES
      num_microbatches: 8      # -> ROUNDPIPE_NUM_MICROBATCHES
      async_optimizer: true    # -> ROUNDPIPE_ASYNC_OPTIMIZER
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

from ..config import ENV_PREFIX, Given, RoundPipeConfig, SettingError

SECTION = "roundpipe"
ENABLED_KEY = "enabled"


def setting_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RoundPipeConfig)]


def default_config_path() -> str:
    """Where `accelerate-roundpipe config` writes by default: beside accelerate's own default config, not over it
    (plain `accelerate launch` reads that one and would reject the `roundpipe:` section)."""
    from accelerate.commands.config.config_args import default_yaml_config_file

    return os.path.join(os.path.dirname(default_yaml_config_file), "roundpipe_config.yaml")


def read_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            return json.load(f)
        import yaml

        return yaml.safe_load(f) or {}


def write_config(config: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        if path.endswith(".json"):
            json.dump(config, f, indent=2)
        else:
            import yaml

            yaml.safe_dump(config, f, sort_keys=False)


def _the_section(path: str | None) -> str:
    return f"the `{SECTION}:` section" + (f" of {path}" if path else " of the accelerate config")


def split_section(config: dict[str, Any], path: str | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the accelerate config without the section, the section or None); `path`: the file it was read from."""
    rest = {k: v for k, v in config.items() if k != SECTION}
    section = config.get(SECTION)
    if section is not None and not isinstance(section, dict):
        raise SettingError(f"{_the_section(path)} must be a mapping of settings, e.g. `{SECTION}: {{devices: "
                           f"'cuda:0,cuda:1', num_microbatches: 8}}`; got {section!r}.", "given")
    return rest, section


def section_sources(path: str | None) -> dict[str, Given]:
    """Each setting of a section read from `path` as a refusal names it: "`num_microbatches: zero` in the
    `roundpipe:` section of c.yaml"."""
    return {name: Given(f"`{name}: {{value}}`", f" in {_the_section(path)}") for name in setting_names()}


def section_variables(section: dict[str, Any], path: str | None = None) -> dict[str, str]:
    """The `ROUNDPIPE_*` variables a section sets (the `enabled` switch excluded); unknown keys are errors."""
    names = setting_names()
    out = {}
    for key, value in section.items():
        if key == ENABLED_KEY or value is None:
            continue
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            raise SettingError(f"unknown key `{key}` in {_the_section(path)}{hint}; known keys: "
                               f"{', '.join([ENABLED_KEY, *names])}.", "given")
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        out[ENV_PREFIX + key.upper()] = str(value)
    return out


def base_accelerate_config(use_cpu: bool, mixed_precision: str = "no") -> dict[str, Any]:
    """A single-process accelerate config (RoundPipe drives every GPU from that one process)."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "NO",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": 1,
        "num_processes": 1,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": use_cpu,
    }
