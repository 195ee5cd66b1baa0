"""`RoundPipeTrainer` + `RoundPipeTrainingArguments`: per_device_train_batch_size = rows, max_steps = warm + iters,
the batch's rows repeated with sequential sampling, no evaluation or saving, timed by a callback (on_step_begin of
the first timed step to on_step_end of the last)."""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from accelerate_roundpipe import RoundPipeConfig, RoundPipeTrainer, RoundPipeTrainingArguments
from benchmarks.memory import PeakMeter
from benchmarks.runners import common
from benchmarks.timing import StepClock, engine_waiter


class RepeatedRows(torch.utils.data.Dataset):
    """The batch's rows repeated: with sequential sampling, every Trainer step gets exactly `batch`."""

    def __init__(self, batch: dict, steps: int) -> None:
        self.batch, self.rows = batch, batch["input_ids"].shape[0]
        self.length = self.rows * steps

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {k: v[index % self.rows] for k, v in self.batch.items()}


def _sequential_trainer() -> tuple[type, dict]:
    """The Trainer class and arguments for sequential sampling: an argument where transformers has one, else a
    subclass with the same effect."""
    from transformers import TrainingArguments

    if any(f.name == "train_sampling_strategy" for f in dataclasses.fields(TrainingArguments)):
        return RoundPipeTrainer, {"train_sampling_strategy": "sequential"}

    class SequentialTrainer(RoundPipeTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return SequentialTrainer, {}


def run_trainer(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
                lr: float = 1e-5, logging_steps: int = 1, max_grad_norm: float = 0.0) -> dict:
    from transformers import TrainerCallback

    rows, seq = common.check_batch(batch, warm, iters)
    common.reset_accelerate_state()
    cuda = common.cuda_indices(config)
    meter = PeakMeter(cuda)
    trainer = None
    clock = StepClock(warm, iters, engine_waiter(lambda: trainer.roundpipe_engine, cuda))
    losses: list[float] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            clock.end(state.global_step - 1)  # global_step already counts this step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    roundpipe = {"roundpipe_" + name: value for name, value in common.config_values(config).items()}
    trainer_cls, sequential = _sequential_trainer()
    bf16 = common.is_bf16(model)
    adamw = common.ADAMW
    with tempfile.TemporaryDirectory(prefix="roundpipe-bench-trainer-") as output_dir:
        args = RoundPipeTrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
            max_steps=warm + iters, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch_fused", weight_decay=adamw["weight_decay"], adam_beta1=adamw["betas"][0],
            adam_beta2=adamw["betas"][1], adam_epsilon=adamw["eps"], max_grad_norm=max_grad_norm, bf16=bf16,
            logging_steps=logging_steps, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, dataloader_pin_memory=torch.cuda.is_available(),
            use_cpu=not torch.cuda.is_available(), **sequential, **roundpipe)
        try:
            trainer = trainer_cls(model=model, args=args, train_dataset=RepeatedRows(batch, warm + iters),
                                  callbacks=[Timing()])
            trainer.train()
            engine = trainer.roundpipe_engine
            path = {"api": "RoundPipeTrainer + RoundPipeTrainingArguments", "bf16": bf16,
                    "optimizer": common.describe_optimizer(trainer.optimizer.optimizer.inner),
                    "max_grad_norm": max_grad_norm, "lr_scheduler_type": "constant", "logging_steps": logging_steps,
                    "optimizer_placement": common.placement_of(engine),
                    "saved_inputs": common.saved_inputs_of(engine)}
            return common.run_result(clock, losses, rows, seq, engine.num_microbatches_for(rows, seq), meter, path)
        finally:
            common.close_engine(trainer.roundpipe_engine if trainer is not None else None)
            common.reset_accelerate_state()
