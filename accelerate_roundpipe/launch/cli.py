"""The `accelerate-roundpipe` command: `config`, `launch` and `simulate`.

    accelerate-roundpipe config [--config_file F] [--devices cuda:0,cuda:1] [--num_microbatches 8] ...
    accelerate-roundpipe launch --roundpipe [--config_file F] [accelerate launch args] script.py ARGS
    accelerate-roundpipe simulate --model qwen3-1.7b --devices 8 --microbatches 16 [--json]

`launch` parses its arguments with accelerate's own `accelerate launch` parser (plus `--roundpipe`), strips the
`roundpipe:` section from the config file (accelerate rejects unknown keys), exports the section as `ROUNDPIPE_*`
variables (variables already set in the environment win), checks the launch starts one process per machine
([Note: one process per machine]; `--multi_gpu --num_machines N --num_processes N` for several), and hands over to
accelerate's launcher with the script wrapped in `-m accelerate_roundpipe.run`. Without `--roundpipe` and without
`enabled: true` in the section it is a plain `accelerate launch`.

A setting refused by any subcommand (a `SettingError`) is one `accelerate-roundpipe CMD: error: ...` line and exit
status 2 (`refusals.py`), naming the setting as that command took it: `config`'s `--<field>` flags, the section's
keys with the file's path, the variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import subprocess
import sys
import tempfile

from ..config import ENV_PREFIX, Given, RoundPipeConfig, SettingError
from ..integrations.plugin import RoundPipePlugin
from ..integrations.process_layout import MULTI_PROCESS_TYPES, ONE_PROCESS_PER_MACHINE
from .config_file import (
    ENABLED_KEY,
    SECTION,
    base_accelerate_config,
    default_config_path,
    read_config,
    section_sources,
    section_variables,
    setting_names,
    split_section,
    write_config,
)
from .refusals import settings_refused_as

RUN_MODULE = "accelerate_roundpipe.run"


def config_command(argv: list[str]) -> str:
    """Write a single-process accelerate config with a `roundpipe:` section; returns its path."""
    parser = argparse.ArgumentParser(prog="accelerate-roundpipe config",
                                     description="Write an accelerate config file with a `roundpipe:` section.")
    parser.add_argument("--config_file", default=None,
                        help="where to write it (default: roundpipe_config.yaml in accelerate's config folder, "
                             "$HF_HOME/accelerate, beside accelerate's own default config, which stays usable by "
                             "plain `accelerate launch`; the path is printed when written)")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    for f in dataclasses.fields(RoundPipeConfig):
        parser.add_argument(f"--{f.name}", default=None,
                            help=f"{f.metadata.get('help', '')} (written as `{f.name}:`, {ENV_PREFIX}{f.name.upper()})")
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in setting_names() if getattr(args, name) is not None}
    # Check the values now, not at launch time; a refusal names the flag as this command spells it.
    RoundPipePlugin(**given, sources={name: Given(f"--{name} {{value}}") for name in given})
    import torch  # after the checks: a refusal is said without waiting for it

    section = {ENABLED_KEY: True, **{name: _yaml_value(value) for name, value in given.items()}}
    config = base_accelerate_config(use_cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    config[SECTION] = section
    path = args.config_file or default_config_path()
    write_config(config, path)
    print(f"accelerate config with RoundPipe written to {path}")
    return path


def _yaml_value(text: str) -> bool | int | float | str:
    """'8' -> 8, 'false' -> False, 'cuda:0,cuda:1' stays a string: the file reads like a hand-written one."""
    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _read_config(path: str) -> dict:
    """The accelerate config file `--config_file` names; a file that cannot be read is a setting refused."""
    if not os.path.isfile(path):
        raise SettingError(f"--config_file {path}: no such file.", "given")
    try:
        config = read_config(path)
    except (OSError, ValueError) as error:  # yaml's and json's parse errors are ValueErrors
        raise SettingError(f"--config_file {path}: not a readable accelerate config ({error}).", "given") from None
    if not isinstance(config, dict):
        raise SettingError(f"--config_file {path}: not an accelerate config (a mapping of settings); got "
                           f"{type(config).__name__}.", "given")
    return config


def _check_settings(section_variables_: dict[str, str], path: str | None) -> None:
    """Refuse bad ROUNDPIPE_* names or values, and the section's values (`section_variables_`: those the environment
    does not already set), each named where it was given: the variable, or the key in the file at `path`."""
    from_file = {name.removeprefix(ENV_PREFIX).lower(): value for name, value in section_variables_.items()}
    sources = section_sources(path)
    RoundPipePlugin(**from_file, sources={name: sources[name] for name in from_file})


def launch_command(argv: list[str]) -> None:
    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "accelerate-roundpipe launch"
    parser.add_argument("--roundpipe", action="store_true",
                        help="run the script on RoundPipe (as `python -m accelerate_roundpipe.run` does)")
    args = parser.parse_args(argv)
    use_roundpipe = args.roundpipe
    del args.roundpipe
    if args.config_file is None and os.path.isfile(default_config_path()):
        args.config_file = default_config_path()

    config, section, path = ({}, None, args.config_file)
    if path is not None:
        config, section = split_section(_read_config(path), path)
    use_roundpipe = use_roundpipe or bool(section and section.get(ENABLED_KEY, False))

    with tempfile.TemporaryDirectory(prefix="accelerate_roundpipe_") as scratch:
        if section is not None:
            # accelerate must never see the section: hand it a copy of the file without it.
            stripped = os.path.join(scratch, "accelerate_config" + os.path.splitext(args.config_file)[1])
            write_config(config, stripped)
            args.config_file = stripped
        if use_roundpipe:
            # The section's settings become variables; one the environment already sets stays the environment's.
            from_file = {name: value for name, value in section_variables(section or {}, path).items()
                         if name not in os.environ}
            _check_launch_layout(args, config, environ={**os.environ, **from_file}, path=path)
            _check_settings(from_file, path)  # before anything is started (or exported)
            os.environ.update(from_file)
            if args.num_processes is None and "num_processes" not in config:
                # One per machine; accelerate would otherwise start one process per GPU.
                args.num_processes = args.num_machines or int(config.get("num_machines", 1))
            args.training_script_args = [*(["-m"] if args.module else []), args.training_script,
                                         *args.training_script_args]
            args.training_script, args.module = RUN_MODULE, True
        try:
            accelerate_launch(args)
        except subprocess.CalledProcessError as error:  # the script failed; its traceback is already printed
            raise SystemExit(error.returncode) from None


def _check_launch_layout(args, config: dict, environ: dict[str, str] | None = None, path: str | None = None) -> None:
    """One process per machine ([Note: one process per machine]): refuse launch settings that start one process
    per GPU or shard the model, before anything is started (`path`: the config file `config` came from)."""
    environ = os.environ if environ is None else environ
    problems = [f"--{flag}" for flag in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "tpu")
                if getattr(args, flag, False)]
    distributed = str(config.get("distributed_type", "NO")).split(".")[-1]
    if distributed not in ("NO", *MULTI_PROCESS_TYPES):
        problems.append(f"distributed_type: {distributed} in the config file" + (f" {path}" if path else ""))
    if problems:
        raise SettingError(f"--roundpipe with {', '.join(problems)} would shard the model, but RoundPipe replaces "
                           f"DeepSpeed, FSDP and Megatron-LM. {ONE_PROCESS_PER_MACHINE}", "given")
    num_processes = args.num_processes if args.num_processes is not None else int(config.get("num_processes", 1))
    num_machines = args.num_machines if args.num_machines is not None else int(config.get("num_machines", 1))
    per_machine = num_processes / max(num_machines, 1)
    devices = environ.get(ENV_PREFIX + "DEVICES", "")
    cpu_workers_only = bool(devices) and all(d.strip() == "cpu" for d in devices.split(",") if d.strip())
    if per_machine > 1 and not cpu_workers_only:
        # Every process launched on a machine reads the same ROUNDPIPE_DEVICES (unset: every visible GPU).
        claimed = f"ROUNDPIPE_DEVICES={devices}" if devices else "every visible GPU (ROUNDPIPE_DEVICES unset)"
        raise SettingError(f"--roundpipe with {num_processes} process(es) on {num_machines} machine(s) start "
                           f"{per_machine:g} per machine, each driving {claimed}: that is one process per GPU. "
                           f"{ONE_PROCESS_PER_MACHINE} (Several processes on one machine are accepted only with CPU "
                           f"workers, ROUNDPIPE_DEVICES=cpu,...)", "given")


def simulate_command(argv: list[str]) -> None:
    """Bubble ratios of RoundPipe and the classic schedules (see `accelerate_roundpipe.plan.simulate_cli`)."""
    from ..plan.simulate_cli import main as simulate_main

    simulate_main(argv)


COMMANDS = {
    "config": (config_command, "write an accelerate config file with a `roundpipe:` section (`launch` reads it)"),
    "launch": (launch_command, "run an unedited Trainer or Accelerate script on RoundPipe: `accelerate launch` "
                               "arguments plus --roundpipe"),
    "simulate": (simulate_command, "bubble ratios of RoundPipe and the classic schedules for a model (no GPU)"),
}


def usage() -> str:
    """The command's help: what each subcommand does and how to get its options."""
    lines = ["usage: accelerate-roundpipe {config,launch,simulate} [ARGS ...]", "",
             "RoundPipe pipeline training underneath Hugging Face Accelerate and transformers.Trainer.", "",
             "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "examples:"]
    lines += [line.replace("    ", "  ", 1) for line in __doc__.splitlines() if line.startswith("    accelerate-")]
    lines += ["", "`accelerate-roundpipe COMMAND --help` lists a command's options. Without the command:",
              "  python -m accelerate_roundpipe.run script.py ARGS   (settings from ROUNDPIPE_* variables)",
              "Every setting, its variable and its default: docs/configuration.md."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"accelerate-roundpipe: unknown command {argv[0]!r}{hint}; the commands are "
              f"{', '.join(COMMANDS)}.\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    # A setting refused, in any subcommand: one `accelerate-roundpipe CMD: error: ...` line, exit status 2.
    with settings_refused_as(f"accelerate-roundpipe {argv[0]}"):
        COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    main()
