"""Every script in examples/ runs, with short settings, as its docstring says (in this process, on the CPU workers
the examples pick without a GPU), so a shipped example never breaks unnoticed. The stock scripts are run by
`test_accelerate_loop_stock.py` and `test_trainer_stock.py`; `test_every_example_is_run` keeps the list whole."""

from __future__ import annotations

import os
import re

import pytest
from roundpipe_testing import LOOP_SCRIPT, REPO, TRAINER_SCRIPT, run_in_process, trainer_args

EXAMPLES = os.path.join(REPO, "examples")

# script -> the test file that runs it, and the name it runs it by there
RUN_BY = {
    "engine_alone.py": ("test_examples.py", '"engine_alone.py"'),
    "accelerate_loop.py": ("test_examples.py", '"accelerate_loop.py"'),
    "trainer.py": ("test_examples.py", '"trainer.py"'),
    "lora.py": ("test_examples.py", '"lora.py"'),
    "make_tiny_assets.py": ("test_examples.py", '"make_tiny_assets.py"'),
    "stock_accelerate_clm.py": ("test_accelerate_loop_stock.py", "LOOP_SCRIPT"),
    "stock_trainer_clm.py": ("test_trainer_stock.py", "TRAINER_SCRIPT"),
}


def _example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


def test_every_example_is_run():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == sorted(RUN_BY), "add the new example to RUN_BY and run it in a test"
    assert (LOOP_SCRIPT, TRAINER_SCRIPT) == (_example("stock_accelerate_clm.py"), _example("stock_trainer_clm.py"))
    here = os.path.dirname(os.path.abspath(__file__))
    for script, (test_file, name) in RUN_BY.items():
        with open(os.path.join(here, test_file)) as f:
            assert f.read().count(name) >= (2 if test_file == "test_examples.py" else 1), \
                f"{test_file} does not run {script}"


def test_engine_alone(capsys):
    run_in_process(_example("engine_alone.py"), ["--steps", "6", "--batch-size", "32"], roundpipe=False)
    assert "held-out accuracy" in capsys.readouterr().out


def test_accelerate_loop(capsys, tmp_path):
    """Logs the loss and the gradient norm `clip_grad_norm_` returned (formatted with `:.3f`), evaluates, saves."""
    run_in_process(_example("accelerate_loop.py"), ["--steps", "2", "--gradient_accumulation_steps", "2",
                                                    "--output_dir", str(tmp_path)], roundpipe=False)
    out = capsys.readouterr().out
    assert re.search(r"step   2  loss \d+\.\d{4}  grad norm \d+\.\d{3}", out), out
    assert "held-out loss" in out
    assert os.path.exists(os.path.join(tmp_path, "config.json"))


def test_trainer_then_resume(capsys, tmp_path):
    """A checkpoint half-way, evaluation, the model saved; `--resume` continues from the last checkpoint."""
    argv = ["--max_steps", "4", "--logging_steps", "2", "--output_dir", str(tmp_path)]
    run_in_process(_example("trainer.py"), argv, roundpipe=False)
    assert "'eval_loss'" in capsys.readouterr().out
    assert {"checkpoint-2", "checkpoint-4", "config.json"} <= set(os.listdir(tmp_path))
    run_in_process(_example("trainer.py"), [*argv, "--resume"], roundpipe=False)
    assert "'eval_loss'" in capsys.readouterr().out


def test_lora(capsys, tmp_path):
    """The adapters reloaded onto a fresh base give the trained model's loss."""
    run_in_process(_example("lora.py"), ["--max_steps", "3", "--logging_steps", "1", "--output_dir", str(tmp_path)],
                   roundpipe=False)
    out = capsys.readouterr().out
    trained, reloaded = map(float, re.search(r"trained model (\S+), adapters reloaded .* (\S+)$", out,
                                             re.MULTILINE).groups())
    assert trained == pytest.approx(reloaded, abs=1e-5)
    assert os.path.exists(os.path.join(tmp_path, "adapter_config.json"))


def test_make_tiny_assets_feeds_the_stock_script_on_roundpipe(tmp_path):
    """The README's way: `make_tiny_assets.py DIR`, then the stock Trainer script through the launcher."""
    assets = str(tmp_path / "tiny")
    run_in_process(_example("make_tiny_assets.py"), [assets], roundpipe=False)
    output_dir = str(tmp_path / "out")
    run_in_process(TRAINER_SCRIPT, trainer_args(assets, output_dir, 2), roundpipe=True,
                   env={"ROUNDPIPE_DEVICES": "cpu,cpu"})
    assert os.path.exists(os.path.join(output_dir, "trainer_state.json"))
