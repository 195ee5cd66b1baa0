"""Signs that RoundPipe is on, from every way in: the start summary, the timeline trace written without `close()`
(Trainer, Accelerate loop, launched script), and RoundPipe's metrics in the Trainer's TensorBoard event file."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import sys

import pytest
import torch
from roundpipe_testing import ROUNDPIPE_ENV, run_subprocess, subprocess_env

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin, RoundPipeTrainer, RoundPipeTrainingArguments

STEPS, LOGGING_STEPS = 4, 2
METRICS = ("roundpipe/tokens_per_s", "roundpipe/mfu", "roundpipe/bubble", "roundpipe/host_rss_gib")


def tiny_llama(vocab_size: int):
    from transformers import LlamaForCausalLM, set_seed

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    set_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size))


def trace_tasks(path: str) -> list[dict]:
    """The task spans of a trace file (the worker host tracks), after checking it parses as a Chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and names[e["tid"]].endswith(" host")]


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A RoundPipeTrainer run reporting to TensorBoard, recording a trace, never closed; its stderr kept."""
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets

    torch.set_num_threads(1)
    out = str(tmp_path_factory.mktemp("trainer_signs"))
    tokenizer = build_tokenizer()
    train, _ = lm_datasets(tokenizer, block_size=32)
    trace = os.path.join(out, "trace.json")
    args = RoundPipeTrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=LOGGING_STEPS,
        save_strategy="no",
        report_to=["tensorboard"],
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        dataloader_pin_memory=False,
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,
        roundpipe_devices="cpu,cpu",
        roundpipe_num_microbatches=2,
        roundpipe_trace_path=trace,
        roundpipe_peak_tflops=0.001,
    )
    trainer = RoundPipeTrainer(model=tiny_llama(len(tokenizer)), args=args, train_dataset=train)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        trainer.train()
    yield trainer, out, trace, stderr.getvalue()
    trainer.roundpipe_engine.close()


def test_trainer_writes_the_trace_when_training_ends(trainer_run):
    """[Note: trace at exit]: `train()` ends with the trace on disk, though nothing closed the engine."""
    trainer, _, trace, stderr = trainer_run
    engine = trainer.roundpipe_engine
    assert not engine.closed
    tasks = trace_tasks(trace)
    per_pass = len(engine.schedule(2))
    assert len(tasks) == STEPS * 2 * per_pass  # every pass of every step (2 accumulated batches per step)
    assert {e["name"].rsplit("@", 1)[1] for e in tasks} == {"d0", "d1"}
    assert f"trace written to {trace}" in stderr


def test_trainer_prints_one_summary_with_its_settings(trainer_run):
    trainer, _, trace, stderr = trainer_run
    assert stderr.count("RoundPipe is on: 2 worker(s) (cpu, cpu)") == 1
    for line in (
        "micro-batches: 2 per pass (num_microbatches)",
        "optimizer: AdamW, exact step",
        "clipping: max_grad_norm=1 (exact, this step's norm, no pipeline drain)",
        "gradient accumulation: 2 batch(es) per optimizer step",
        f"trace: {trace}",
        "host memory: about",
    ):
        assert f"[roundpipe]   {line}" in stderr, line


def test_tensorboard_event_file_carries_roundpipe_metrics(trainer_run):
    """`report_to=["tensorboard"]`: a real event file, read back, holds tokens/s, MFU, bubble and host memory at
    every logging step, with the values the Trainer logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, out, _, _ = trainer_run
    files = glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(files[0])
    events.Reload()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == list(range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS))
    for name in METRICS:
        scalars = events.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == [entry["step"] for entry in logged], name
        assert [s.value for s in scalars] == pytest.approx([entry[name] for entry in logged], rel=1e-6), name
    assert all(e["roundpipe/tokens_per_s"] > 0 and e["roundpipe/mfu"] > 0 for e in logged)
    assert all(0 <= e["roundpipe/bubble"] < 1 and e["roundpipe/host_rss_gib"] > 0 for e in logged)


def _lm_batches(vocab_size: int, count: int, rows: int = 4, seq: int = 16):
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        ids = torch.randint(0, vocab_size, (rows, seq), generator=generator)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_accelerate_loop_writes_the_trace_at_end_training(tmp_path, capsys):
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    reset_accelerate_state()
    trace = str(tmp_path / "trace.json")
    accelerator = RoundPipeAccelerator(
        roundpipe_plugin=RoundPipePlugin(devices=["cpu", "cpu"], num_microbatches=2, trace_path=trace)
    )
    model = tiny_llama(128)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.train()
    for batch in _lm_batches(128, 3):
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    engine = accelerator.roundpipe_engine(model)
    assert not os.path.exists(trace)
    accelerator.end_training()
    assert len(trace_tasks(trace)) == 3 * len(engine.schedule(2))
    err = capsys.readouterr().err
    assert err.count("RoundPipe is on") == 1 and f"trace written to {trace}" in err
    assert "clipping: exact, where the loop calls accelerator.clip_grad_norm_" in err
    engine.close()
    reset_accelerate_state()


LOOP_WITHOUT_AN_END = """
import torch
from accelerate import Accelerator
from transformers import LlamaForCausalLM, LlamaConfig

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2))
accelerator = Accelerator()
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
model.train()
for step in range(3):
    ids = torch.randint(0, 128, (4, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
print("loop done")  # no end_training(), no close(): the script just ends
"""


def test_launched_script_writes_the_trace_at_exit(tmp_path):
    """`python -m accelerate_roundpipe.run script.py` on a stock loop that neither ends training nor closes
    anything: the summary is printed and the trace is on disk when the process has exited."""
    script, trace = tmp_path / "loop.py", str(tmp_path / "trace.json")
    script.write_text(LOOP_WITHOUT_AN_END)
    env = subprocess_env(str(tmp_path), {**ROUNDPIPE_ENV, "ROUNDPIPE_TRACE": trace})
    result = run_subprocess([sys.executable, "-m", "accelerate_roundpipe.run", str(script)], env, timeout=180)
    assert "loop done" in result.stdout
    assert result.stderr.count("RoundPipe is on: 2 worker(s) (cpu, cpu)") == 1
    assert f"trace written to {trace}" in result.stderr
    tasks = trace_tasks(trace)
    assert {e["name"].rsplit("@", 1)[1] for e in tasks} == {"d0", "d1"} and len(tasks) >= 2
