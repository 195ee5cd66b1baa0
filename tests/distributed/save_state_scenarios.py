"""What each rank of the `save_state` tests runs (spawned by `ranks.py`): a stock Accelerate loop on
`RoundPipeAccelerator` over a tiny Llama, CPU workers, gloo, one process per rank, as a user writes it; the state
saved on every rank, or under `if accelerator.is_main_process:` ([Note: tagged agreements])."""

from __future__ import annotations

import os
import time

import torch

SEQ, VOCAB, ROWS, ROWS_PER_RANK, STEPS, SAVE_AT = 16, 64, 16, 2, 4, 2


class TokenRows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(4, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


def _accelerator(rank: int, world_size: int, wait_timeout_s: float):
    os.environ.update(ROUNDPIPE_DEVICES="cpu", ROUNDPIPE_NUM_MICROBATCHES="1", ROUNDPIPE_ASYNC_OPTIMIZER="false",
                      ROUNDPIPE_WAIT_TIMEOUT_S=str(wait_timeout_s), ACCELERATE_USE_CPU="true",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from accelerate_roundpipe import RoundPipeAccelerator

    return RoundPipeAccelerator()


def _model():
    from end_of_run_scenarios import tiny_causal_lm

    return tiny_causal_lm()


def _main_process_saves(accelerator, directory: str) -> dict:
    """The user's `if accelerator.is_main_process: accelerator.save_state(directory)`, then
    `accelerator.wait_for_everyone()`: what this rank raised, and how long it took."""
    started = time.monotonic()
    error = None
    try:
        if accelerator.is_main_process:
            accelerator.save_state(directory)
        accelerator.wait_for_everyone()
    except Exception as caught:  # noqa: BLE001 - reported to the test
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "elapsed": time.monotonic() - started,
            "written": sorted(os.listdir(directory)) if os.path.isdir(directory) else None}


def train_then_save(rank: int, world_size: int, every_rank_dir: str, main_only_dir: str,
                    wait_timeout_s: float) -> dict:
    """`STEPS` steps, `save_state(every_rank_dir)` on every rank after step `SAVE_AT`; then the state saved under
    `if accelerator.is_main_process:` into `main_only_dir`. Returns the losses (rank 0's are the global batch's)
    and what the main-process-only save did."""
    accelerator = _accelerator(rank, world_size, wait_timeout_s)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenRows(), batch_size=ROWS_PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == SAVE_AT:
            accelerator.save_state(every_rank_dir)
        if step == STEPS:
            break
    # Last: a mismatched call leaves the ranks' agreements out of step for good.
    return {"losses": losses, "main_only": _main_process_saves(accelerator, main_only_dir)}


def resume(rank: int, world_size: int, directory: str, wait_timeout_s: float) -> list[float]:
    """A new run: `load_state(directory)`, then the steps after `SAVE_AT`; their losses."""
    accelerator = _accelerator(rank, world_size, wait_timeout_s)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenRows(), batch_size=ROWS_PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.load_state(directory)
    losses = []
    for batch in accelerator.skip_first_batches(loader, SAVE_AT):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == STEPS - SAVE_AT:
            break
    return losses


def evaluate_then_save(rank: int, world_size: int, directory: str, wait_timeout_s: float) -> dict:
    """No optimizer (nothing held per rank): two evaluation batches, then the main process alone saves."""
    accelerator = _accelerator(rank, world_size, wait_timeout_s)
    model = accelerator.prepare(_model())
    loader = accelerator.prepare(torch.utils.data.DataLoader(TokenRows(), batch_size=ROWS_PER_RANK))
    model.eval()
    with torch.no_grad():
        for _, batch in zip(range(2), loader):
            model(**batch)
    return _main_process_saves(accelerator, directory)
