"""What each rank of the in-process `RoundPipeTrainer` data-parallel tests runs (spawned processes, see `ranks.py`):
a tiny Llama from a config, CPU workers, gloo; one rank stalls or dies at a chosen point and the other reports how
and when it stopped."""

from __future__ import annotations

import os
import time

import torch

STEPS, SAVE_AT, ROWS_PER_RANK = 4, 2, 2


def trainer(output_dir: str, wait_timeout_s: float | None, trainer_class=None, **args):
    from transformers import LlamaForCausalLM

    from accelerate_roundpipe.integrations import RoundPipeTrainer, RoundPipeTrainingArguments
    from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config

    os.environ.update(ROUNDPIPE_DEVICES="cpu", ROUNDPIPE_NUM_MICROBATCHES="1", ROUNDPIPE_ASYNC_OPTIMIZER="false")
    tokenizer = build_tokenizer()
    train, _ = lm_datasets(tokenizer, block_size=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=32, num_hidden_layers=2))
    settings = dict(output_dir=output_dir, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=ROWS_PER_RANK,
                    learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                    dataloader_num_workers=0, seed=0)
    settings.update(args)
    if wait_timeout_s is not None:
        settings["roundpipe_wait_timeout_s"] = wait_timeout_s
    return (trainer_class or RoundPipeTrainer)(model=model, args=RoundPipeTrainingArguments(**settings),
                                               train_dataset=train)


def _wait_for(flag: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.1)


def a_rank_stalls(rank: int, world_size: int, output_dir: str, where: str, wait_timeout_s: float) -> dict:
    """Rank 1 stalls (until rank 0 is done) or dies (`os._exit(3)`) right after step `SAVE_AT` ("step") or while
    writing checkpoint-`SAVE_AT` ("save", "killed in save"); rank 0 reports its error and how long after the fault
    it came."""
    from transformers import TrainerCallback

    from accelerate_roundpipe.integrations import RoundPipeTrainer

    done = os.path.join(output_dir, "rank0-done")
    fault_at: dict[str, float] = {}

    def fault() -> None:
        fault_at["t"] = time.monotonic()
        if rank == 1:
            if where == "killed in save":
                os._exit(3)
            _wait_for(done)
            os._exit(3)  # stalled for good: its own collectives would only time out later

    class FaultAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if where == "step" and state.global_step == SAVE_AT:
                fault()

    class FaultInSave(RoundPipeTrainer):
        def _save_rng_state(self, output_dir):  # inside the staged checkpoint, after the optimizer shard
            super()._save_rng_state(output_dir)
            if where != "step":
                fault()

    run = trainer(output_dir, wait_timeout_s, FaultInSave, save_strategy="steps", save_steps=SAVE_AT)
    run.add_callback(FaultAfterStep())
    error = None
    try:
        run.train()
    except Exception as caught:  # noqa: BLE001 - reported to the test
        error = f"{type(caught).__name__}: {caught}"
    elapsed = time.monotonic() - fault_at["t"] if "t" in fault_at else None
    with open(done, "w"):
        pass
    return {"error": error, "elapsed": elapsed, "files": sorted(os.listdir(output_dir))}


def save_two_process_checkpoint(rank: int, world_size: int, output_dir: str) -> None:
    """The uninterrupted data-parallel run, saving checkpoint-`SAVE_AT` (its optimizer shards)."""
    trainer(output_dir, None, save_strategy="steps", save_steps=SAVE_AT).train()
