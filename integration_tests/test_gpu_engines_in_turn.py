"""Several engines in one process on CUDA (skipped without a GPU): notebooks, sweeps and TRL build engines in turn,
and each must release the host memory it page-locked ([Note: unlock before free]); and workers that share one GPU
compute what one worker does, bitwise (the only multi-worker check on real CUDA while one GPU is lent).

Runs under pytest, or directly: `python integration_tests/test_gpu_engines_in_turn.py`.
"""

from __future__ import annotations

import gc
import tempfile

import pytest
import torch
from test_gpu_integrations import STEPS, _data, _losses, _model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(rows, vocab_size: int, devices: str, output_dir: str):
    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    model = _model(vocab_size)
    args = RoundPipeTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, roundpipe_devices=devices,
        roundpipe_num_microbatches=4)
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    weights = {name: p.detach().clone() for name, p in model.state_dict().items()}
    return _losses(trainer), weights


def test_four_trainers_in_turn_in_one_process(tmp_path=None):
    output_dir = str(tmp_path or tempfile.mkdtemp())
    tokenizer, rows = _data()
    runs = []
    for _ in range(4):  # each run's trainer and model dropped by the next, as a notebook cell run again
        runs.append(_train(rows, len(tokenizer), "cuda:0", output_dir))
        gc.collect()
    for losses, weights in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(weights[k], runs[0][1][k]) for k in weights)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_sharing_one_gpu_match_one_worker_bitwise(workers, tmp_path=None):
    output_dir = str(tmp_path or tempfile.mkdtemp())
    tokenizer, rows = _data()
    one_losses, one_weights = _train(rows, len(tokenizer), "cuda:0", output_dir)
    losses, weights = _train(rows, len(tokenizer), ",".join(["cuda:0"] * workers), output_dir)
    assert losses == one_losses
    assert all(torch.equal(weights[k], one_weights[k]) for k in weights)


if __name__ == "__main__":
    test_four_trainers_in_turn_in_one_process()
    for count in (2, 4):
        test_workers_sharing_one_gpu_match_one_worker_bitwise(count)
    print("ok")
