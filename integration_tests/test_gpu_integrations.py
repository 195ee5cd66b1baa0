"""The ways in on CUDA workers (skipped without a GPU): the model's weights stay in host memory, batches stay on the
host, and the losses are those of the stock Trainer / Accelerate loop running the model on the GPU.

Needs no `datasets` (the GPU image may not have it): the data are plain lists of tensors.
Runs under pytest, or directly: `python integration_tests/test_gpu_integrations.py`.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from tiny_llama_model import seeded_tiny_llama as _model  # test_gpu_engines_in_turn.py imports `_model` from here

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 12
GPU_ATOL = 2e-4  # fp32 on the GPU: kernels (and micro-batch split) change the rounding, not the result


def _data(block_size: int = 32):
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_blocks, split_paragraphs

    tokenizer = build_tokenizer()
    train, _ = split_paragraphs()
    blocks = lm_blocks(tokenizer, train, block_size)
    rows = [{k: torch.tensor(blocks[k][i]) for k in blocks} for i in range(len(blocks["input_ids"]))]
    return tokenizer, rows


def one_gpu(args):
    """The stock Trainer's arguments on cuda:0 alone: with several GPUs visible, one process would wrap the model in
    `nn.DataParallel` and train per_device_train_batch_size rows on each GPU, another batch than RoundPipe's."""
    _ = args.device  # the Trainer's device set-up runs once and counts the GPUs; one is what it uses from here
    args._n_gpu = min(args._n_gpu, 1)
    return args


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_trainer_on_a_gpu_worker(tmp_path=None):
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    output_dir = str(tmp_path or tempfile.mkdtemp())
    tokenizer, rows = _data()
    common = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3,
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    reference = Trainer(model=_model(len(tokenizer)), args=one_gpu(TrainingArguments(**common)), train_dataset=rows)
    reference.train()
    assert next(reference.model.parameters()).is_cuda

    model = _model(len(tokenizer))
    args = RoundPipeTrainingArguments(**common, roundpipe_devices="cuda:0", roundpipe_num_microbatches=2,
                                      roundpipe_async_optimizer=False)
    ours = RoundPipeTrainer(model=model, args=args, train_dataset=rows)
    ours.train()
    assert all(p.device.type == "cpu" for p in model.parameters())  # never moved to cuda:0
    assert [str(d.device) for d in ours.roundpipe_engine.devices] == ["cuda:0"]
    worst = max(abs(a - b) for a, b in zip(_losses(ours), _losses(reference)))
    assert worst < GPU_ATOL, (worst, _losses(ours), _losses(reference))
    ours.roundpipe_engine.close()


def accelerate_loop(accelerator, batch_size: int):
    """(model, last batch, losses) of STEPS steps of a stock Accelerate loop (clipping at 1.0) on the tiny model."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    tokenizer, rows = _data()
    model = _model(len(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(rows, batch_size=batch_size, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for _, batch in zip(range(STEPS), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, batch, losses


def test_accelerate_loop_on_a_gpu_worker():
    import accelerate

    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    reset_accelerate_state()
    _, _, expected = accelerate_loop(accelerate.Accelerator(), batch_size=4)
    reset_accelerate_state()
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cuda:0"], num_microbatches=2,
                                                                        async_optimizer=False))
    model, batch, losses = accelerate_loop(accelerator, batch_size=4)
    assert batch["input_ids"].device.type == "cpu"  # batches stay on the host
    assert all(p.device.type == "cpu" for p in model.parameters())
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst < GPU_ATOL, (worst, losses, expected)
    accelerator.roundpipe_engine(model).close()


if __name__ == "__main__":
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")
    test_trainer_on_a_gpu_worker()
    print("trainer on cuda:0: ok")
    test_accelerate_loop_on_a_gpu_worker()
    print("accelerate loop on cuda:0: ok")
