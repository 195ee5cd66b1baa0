"""The ways in on two GPUs of one machine (skipped without two): `RoundPipeTrainer` with `roundpipe_devices=
"cuda:0,cuda:1"` and the Accelerate loop with both GPUs in the plugin train as the stock Trainer / loop on one GPU,
at RoundPipe's defaults (the exact step, the optimizer state placed on the GPUs, which then holds buckets on both).

Runs under pytest, or directly: `python integration_tests/test_gpu_two_gpus.py`.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_gpu_integrations import GPU_ATOL, STEPS, _data, _losses, _model, accelerate_loop, one_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
TWO = "cuda:0,cuda:1"


def _trainer_run(devices: str | None, output_dir: str, max_grad_norm: float = 1.0):
    """(losses, weights) of a Trainer run: the stock Trainer on cuda:0 when `devices` is None."""
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    tokenizer, rows = _data()
    common = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=8, learning_rate=3e-3,
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                  max_grad_norm=max_grad_norm)
    model = _model(len(tokenizer))
    if devices is None:
        trainer = Trainer(model=model, args=one_gpu(TrainingArguments(**common)), train_dataset=rows)
    else:
        args = RoundPipeTrainingArguments(**common, roundpipe_devices=devices, roundpipe_num_microbatches=4)
        trainer = RoundPipeTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    if devices is not None:
        engine = trainer.roundpipe_engine
        assert [str(d.device) for d in engine.devices] == devices.split(",")
        engine.synchronize()
    weights = {name: p.detach().float().cpu().clone() for name, p in model.state_dict().items()}
    if devices is not None:
        trainer.roundpipe_engine.close()
    return _losses(trainer), weights


def test_trainer_on_two_gpus_equals_the_stock_trainer_and_one_gpu(tmp_path=None):
    torch.backends.cuda.matmul.allow_tf32 = False
    output_dir = str(tmp_path or tempfile.mkdtemp())
    stock, stock_weights = _trainer_run(None, output_dir)
    one, one_weights = _trainer_run("cuda:0", output_dir)
    two, two_weights = _trainer_run(TWO, output_dir)
    assert len(two) == STEPS
    worst = max(abs(a - b) for a, b in zip(two, stock))
    assert worst < GPU_ATOL, (worst, two, stock)
    worst_one = max(abs(a - b) for a, b in zip(two, one))
    assert worst_one < GPU_ATOL, (worst_one, two, one)
    for name, value in one_weights.items():
        assert torch.allclose(two_weights[name], value, rtol=1e-3, atol=1e-5), name
        assert torch.allclose(two_weights[name], stock_weights[name], rtol=1e-2, atol=1e-4), name
    print(f"two GPUs against one: losses differ by at most {worst_one:.3e}; bitwise: "
          f"{all(torch.equal(two_weights[k], one_weights[k]) for k in one_weights)}")


def test_accelerate_loop_on_two_gpus_trains_as_the_stock_loop():
    import accelerate

    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    torch.backends.cuda.matmul.allow_tf32 = False
    reset_accelerate_state()
    _, _, expected = accelerate_loop(accelerate.Accelerator(), batch_size=8)
    reset_accelerate_state()
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=TWO.split(","), num_microbatches=4))
    model, _, losses = accelerate_loop(accelerator, batch_size=8)
    engine = accelerator.roundpipe_engine(model)
    assert [str(d.device) for d in engine.devices] == TWO.split(",")
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst < GPU_ATOL, (worst, losses, expected)
    engine.close()


if __name__ == "__main__":
    test_trainer_on_two_gpus_equals_the_stock_trainer_and_one_gpu()
    test_accelerate_loop_on_two_gpus_trains_as_the_stock_loop()
    print("ok")
