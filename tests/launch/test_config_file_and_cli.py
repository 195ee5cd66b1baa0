"""The `roundpipe:` config section, `accelerate-roundpipe config/launch` wiring (accelerate's launcher mocked), the
runpy launcher and `install()`."""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest

from accelerate_roundpipe.config import RoundPipeConfig
from accelerate_roundpipe.launch import cli, config_file, install, run_script


def test_section_becomes_roundpipe_variables():
    rest, section = config_file.split_section({"num_processes": 1, "roundpipe": {
        "enabled": True, "devices": ["cuda:0", "cuda:1"], "async_optimizer": False, "num_microbatches": 8}})
    assert rest == {"num_processes": 1}
    assert config_file.section_variables(section) == {
        "ROUNDPIPE_DEVICES": "cuda:0,cuda:1", "ROUNDPIPE_ASYNC_OPTIMIZER": "false", "ROUNDPIPE_NUM_MICROBATCHES": "8"}
    with pytest.raises(ValueError, match="unknown key `num_microbatch`.*did you mean `num_microbatches`"):
        config_file.section_variables({"num_microbatch": 2})
    with pytest.raises(ValueError, match="must be a mapping"):
        config_file.split_section({"roundpipe": "yes"})


def test_config_command_writes_a_file_accelerate_reads_once_stripped(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = cli.config_command(["--config_file", str(tmp_path / "c.yaml"), "--devices", "cpu,cpu",
                               "--num_microbatches", "4", "--async_optimizer", "false"])
    config = config_file.read_config(path)
    assert config["roundpipe"] == {"enabled": True, "devices": "cpu,cpu", "num_microbatches": 4,
                                   "async_optimizer": False}
    assert config["num_processes"] == 1 and config["distributed_type"] == "NO"
    stripped = str(tmp_path / "stripped.yaml")
    config_file.write_config(config_file.split_section(config)[0], stripped)
    assert load_config_from_file(stripped).num_processes == 1
    with pytest.raises(ValueError, match="not a boolean"):
        cli.config_command(["--config_file", str(tmp_path / "bad.yaml"), "--async_optimizer", "maybe"])


def _launched(argv: list[str], env: dict[str, str] | None = None):
    """Run `accelerate-roundpipe launch ARGV` with accelerate's launcher replaced; return what it was given."""
    seen = {}

    def fake_launch(args):
        seen["args"] = args
        seen["config"] = config_file.read_config(args.config_file) if args.config_file else None
        seen["env"] = {k: v for k, v in os.environ.items() if k.startswith("ROUNDPIPE_")}

    with mock.patch.dict(os.environ), mock.patch("accelerate.commands.launch.launch_command", fake_launch):
        for key in [k for k in os.environ if k.startswith("ROUNDPIPE_")]:
            del os.environ[key]  # patch.dict puts everything back afterwards
        os.environ.update(env or {})
        cli.main(["launch", *argv])
    return seen


def test_launch_wraps_the_script_and_exports_the_section(tmp_path):
    config = str(tmp_path / "c.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=True),
                                "roundpipe": {"devices": "cpu,cpu", "num_microbatches": 4}}, config)
    seen = _launched(["--roundpipe", "--config_file", config, "train.py", "--lr", "1"],
                     env={"ROUNDPIPE_NUM_MICROBATCHES": "2"})
    args = seen["args"]
    assert args.module and args.training_script == "accelerate_roundpipe.run"
    assert args.training_script_args == ["train.py", "--lr", "1"]
    assert "roundpipe" not in seen["config"] and seen["config"]["num_processes"] == 1
    assert seen["env"]["ROUNDPIPE_DEVICES"] == "cpu,cpu"
    assert seen["env"]["ROUNDPIPE_NUM_MICROBATCHES"] == "2"  # a variable already set beats the file

    seen = _launched(["--roundpipe", "-m", "pkg.train", "--lr", "1"])
    assert seen["args"].training_script_args == ["-m", "pkg.train", "--lr", "1"]
    assert seen["args"].num_processes == 1  # not one process per GPU


def test_launch_without_roundpipe_is_plain_accelerate(tmp_path):
    config = str(tmp_path / "c.yaml")
    config_file.write_config(config_file.base_accelerate_config(use_cpu=True), config)
    seen = _launched(["--config_file", config, "train.py", "--lr", "1"])
    assert seen["args"].training_script == "train.py" and not seen["args"].module
    assert seen["args"].config_file == config and seen["env"] == {}
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=True),
                                "roundpipe": {"enabled": False, "devices": "cpu"}}, config)
    seen = _launched(["--config_file", config, "train.py"])
    assert seen["args"].training_script == "train.py" and "roundpipe" not in seen["config"]


def test_runpy_launcher_runs_a_script_with_roundpipe_installed(tmp_path, capsys):
    script = tmp_path / "probe.py"
    script.write_text("import sys, accelerate, transformers\n"
                      "print(accelerate.Accelerator.__name__, transformers.Trainer.__name__, sys.argv[1:])\n")
    run_script.main([str(script), "--flag", "1"])
    out = capsys.readouterr().out
    assert "RoundPipeAccelerator RoundPipeTrainer ['--flag', '1']" in out
    import accelerate

    assert accelerate.Accelerator.__name__ == "Accelerator" and not install.is_installed()  # restored afterwards
    run_script.main(["--help"])
    assert "usage: python -m accelerate_roundpipe.run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such script"):
        run_script.main([str(tmp_path / "missing.py")])


def test_install_and_uninstall_swap_the_names():
    import accelerate
    import transformers

    original_accelerator, original_trainer = accelerate.Accelerator, transformers.Trainer
    with install.installed():
        from accelerate import Accelerator
        from transformers import Trainer, TrainingArguments

        assert Accelerator.__name__ == "RoundPipeAccelerator" and issubclass(Accelerator, original_accelerator)
        assert Trainer.__name__ == "RoundPipeTrainer" and issubclass(Trainer, original_trainer)
        assert TrainingArguments.__name__ == "RoundPipeTrainingArguments"
    assert accelerate.Accelerator is original_accelerator and transformers.Trainer is original_trainer


def test_unknown_command_says_so_and_suggests_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lauch", "script.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("accelerate-roundpipe: unknown command 'lauch' (did you mean 'launch'?); the commands "
                          "are config, launch, simulate.")
    assert "usage: accelerate-roundpipe {config,launch,simulate}" in err
    with pytest.raises(SystemExit):
        cli.main(["bogus"])
    assert "unknown command 'bogus'; the commands are" in capsys.readouterr().err


def test_help_describes_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, (_, text) in cli.COMMANDS.items():
        assert f"  {name:<9} {text}" in out
    assert "accelerate-roundpipe COMMAND --help" in out and "python -m accelerate_roundpipe.run" in out


def test_config_help_names_every_setting(capsys):
    """The `config` command's flags carry the engine fields' help texts, which argparse %-formats."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["config", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--{f.name}" in out for f in dataclasses.fields(RoundPipeConfig))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2 and "usage: accelerate-roundpipe" in capsys.readouterr().out


def test_launch_accepts_one_process_per_machine(tmp_path, monkeypatch):
    """[Note: one process per machine]: --multi_gpu over machines, one process each, goes through; several
    processes on one machine only with CPU workers."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # the devices are checked where given: two GPUs
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    seen = _launched(["--roundpipe", "--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank",
                      "0", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "train.py"],
                     env={"ROUNDPIPE_DEVICES": "cuda:0,cuda:1"})
    assert seen["args"].multi_gpu and seen["args"].num_processes == 2 and seen["args"].num_machines == 2
    seen = _launched(["--roundpipe", "--multi_gpu", "--num_machines", "4", "train.py"])
    assert seen["args"].num_processes == 4  # unset: one per machine, not one per GPU
    seen = _launched(["--roundpipe", "--cpu", "--num_processes", "2", "train.py"], env={"ROUNDPIPE_DEVICES": "cpu,cpu"})
    assert seen["args"].num_processes == 2
    config = str(tmp_path / "multi.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=False), "distributed_type": "MULTI_GPU",
                              "num_machines": 2, "num_processes": 2, "roundpipe": {"enabled": True}}, config)
    seen = _launched(["--config_file", config, "train.py"])
    assert seen["args"].training_script == "accelerate_roundpipe.run" and seen["config"]["num_processes"] == 2


@pytest.mark.parametrize("argv,env,match", [
    (["--multi_gpu", "--num_processes", "8"], {}, r"8 process\(es\) on 1 machine\(s\) start 8 per machine, each "
                                                  r"driving every visible GPU"),
    (["--num_processes", "2"], {"ROUNDPIPE_DEVICES": "cuda:0,cuda:1"}, "each driving ROUNDPIPE_DEVICES=cuda:0,cuda:1"),
    (["--multi_gpu", "--num_machines", "2", "--num_processes", "16", "--machine_rank", "0", "--main_process_ip",
      "10.0.0.1", "--main_process_port", "29500"], {}, "8 per machine"),
    (["--use_fsdp"], {}, "--use_fsdp would shard the model"),
    (["--use_deepspeed"], {}, "--use_deepspeed would shard the model"),
])
def test_launch_refuses_one_process_per_gpu_and_sharding(argv, env, match):
    with pytest.raises(SystemExit, match=match) as refused:
        _launched(["--roundpipe", *argv, "train.py"], env=env)
    if "per machine" in match:
        assert "one process per machine" in str(refused.value) and "ROUNDPIPE_DEVICES" in str(refused.value)


def test_launch_refuses_a_sharding_config_file(tmp_path):
    config = str(tmp_path / "fsdp.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=False), "distributed_type": "FSDP",
                              "roundpipe": {"enabled": True}}, config)
    with pytest.raises(SystemExit, match="distributed_type: FSDP in the config file"):
        _launched(["--config_file", config, "train.py"])
