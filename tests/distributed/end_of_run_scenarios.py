"""What each rank of the end-of-run tests runs (spawned by `ranks.py`): a tiny `RoundPipeTrainer` run ended as HF
scripts end one (`train()`, then `save_model()` on every rank, then the process exits), and plain-engine runs whose
ranks leave without synchronizing or after a peer failed."""

from __future__ import annotations

import os

import torch

ROWS, SEQ, VOCAB, STEPS, GLOBAL_BATCH = 8, 16, 64, 2, 4


def tiny_causal_lm():
    """A float32 Llama small enough to start and train in a second (same weights in every process)."""
    from transformers import AutoModelForCausalLM

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, hidden_size=32, num_hidden_layers=2))


class TokenRows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(4, VOCAB, (ROWS, SEQ), generator=generator)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.ids[i]}


def trainer_runs_then_save(rank: int, world_size: int, output_dir: str, runs: int = 1,
                           trace: str | None = None) -> list[str]:
    """`runs` times: `STEPS` exact, clipped steps of the global batch split over the ranks, then
    `trainer.save_model(run_dir)` on every rank, as HF scripts end (rank 0 writes, the others go on at once), then
    the Trainer is dropped (its engine freed as at exit) and the next run starts; the last run ends with the process.
    With `trace`, the last run records `ROUNDPIPE_TRACE=trace` on every rank. Returns the run directories."""
    import gc

    os.environ.update(ROUNDPIPE_DEVICES=",".join(["cpu"] * (2 if world_size == 1 else 1)),
                      ROUNDPIPE_NUM_MICROBATCHES=str(2 if world_size == 1 else 1),
                      ROUNDPIPE_ASYNC_OPTIMIZER="false", ROUNDPIPE_WAIT_TIMEOUT_S="60",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from transformers import TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer

    run_dirs = []
    for run in range(runs):
        if trace is not None and run == runs - 1:
            os.environ["ROUNDPIPE_TRACE"] = trace
        run_dir = os.path.join(output_dir, f"run{run}")
        args = TrainingArguments(output_dir=run_dir, max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH
                                 // world_size, learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                                 dataloader_pin_memory=False, seed=0)
        trainer = RoundPipeTrainer(model=tiny_causal_lm(), args=args, train_dataset=TokenRows())
        trainer.train()
        trainer.save_model(run_dir)
        run_dirs.append(run_dir)
        if run < runs - 1:
            del trainer
            gc.collect()  # the engine's finalizer runs here, as it does at exit
    return run_dirs


def peer_optimizer_fails(rank: int, world_size: int) -> None:
    """Rank 1's optimizer thread fails in its second step, before the reduce-scatter of its first bucket: rank 0's
    optimizer thread is then inside a collective rank 1 never joins when rank 0 learns of the failure (in a pass's
    exchange) and raises; both processes die of their errors (no `close()`, as a script that crashes)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from torch import nn

    from accelerate_roundpipe import RoundPipe, RoundPipeConfig
    from accelerate_roundpipe.runtime.common import faults
    from accelerate_roundpipe.runtime.distribution import gloo_exchange

    from toy_models import batch, tied_model

    gloo_exchange.MIN_STREAM_ELEMENTS = 8  # the buckets' collectives go in chunks over several groups
    # The lagged step: rank 0's next pass does not wait for the step its optimizer thread is stuck in, so it meets
    # rank 1's report of its failure in the pass's exchange at once.
    engine = RoundPipe(tied_model(num_blocks=2), RoundPipeConfig(devices=["cpu"], num_microbatches=2, seed=0,
                                                                 async_optimizer=True, wait_timeout_s=20))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    buckets = len(engine.host_store.trainable_buckets)
    x, mask, y = batch(rows=8)
    hook = faults.raise_at("optimizer.step", buckets + 1, RuntimeError) if rank == 1 else (lambda name: None)
    with faults.injected(hook):
        for _ in range(4):
            engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
