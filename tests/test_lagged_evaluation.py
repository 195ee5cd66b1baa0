"""An evaluation right after `optimizer.step()` under the lagged step reads the newest weights, whatever the host
step's speed ([Note: held steps shown on the caller's thread] in runtime/optimizer/optimizer.py): through the engine
(float64 outputs equal plain PyTorch's lagged run) and through the Trainer (its evaluations during training equal
those of a run that looks before each). A slow host step (a delay at the optimizer's fault point) made every other
evaluation read the weights one step old."""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import LlamaForCausalLM, TrainerCallback, set_seed

from accelerate_roundpipe import RoundPipe, RoundPipeConfig, RoundPipeTrainer, RoundPipeTrainingArguments
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config

from toy_models import batch, plain_adamw_training, run_layers, tied_model

LR, WEIGHT_DECAY, STEPS = 1e-2, 0.1, 4


def _slow_host_step(name: str) -> None:
    if name == "optimizer.step":
        time.sleep(0.05)  # a host step slower than the caller, as on a large model


def _outputs(weights: dict, x, mask) -> torch.Tensor:
    model = tied_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        return run_layers(model, (x, mask))


def test_an_evaluation_after_each_lagged_step_reads_the_newest_weights():
    batches = [[batch(rows=8, seed=10 * step)] for step in range(STEPS)]
    x, mask, _ = batch(rows=5, seed=99)
    _, plain = plain_adamw_training(tied_model, batches, float("inf"), LR, WEIGHT_DECAY, lagged=True)
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, summary=False,
                                                     optimizer_placement="host", async_optimizer=True))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    try:
        with faults.injected(_slow_host_step):
            for step, ((xb, mb, yb),) in enumerate(batches):
                engine.forward_backward(xb, mb, labels=yb, loss_fn=nn.functional.cross_entropy)
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    ours = engine(x, mask)
                torch.testing.assert_close(ours, _outputs(plain[step], x, mask), rtol=1e-12, atol=1e-12,
                                           msg=lambda m, s=step: f"the evaluation after step {s + 1}: {m}")
        engine.synchronize()
        for name, p in engine.module.named_parameters():  # the evaluations changed no step
            torch.testing.assert_close(p, plain[-1][name], rtol=1e-12, atol=1e-12)
    finally:
        engine.close()


class _LookBeforeEachEvaluation(TrainerCallback):
    """The reference: a look (`synchronize()`, which waits for every step) before each evaluation."""

    def __init__(self) -> None:
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.roundpipe_engine.synchronize()


def _trainer_evaluations(tmp_path, look: bool) -> tuple[list[float], list[float]]:
    tokenizer = build_tokenizer()
    train, held_out = lm_datasets(tokenizer, block_size=32)
    set_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer))).double()
    args = RoundPipeTrainingArguments(
        output_dir=str(tmp_path / ("look" if look else "plain")), max_steps=STEPS, per_device_train_batch_size=2,
        per_device_eval_batch_size=3, learning_rate=3e-3, lr_scheduler_type="constant", max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", eval_strategy="steps", eval_steps=1, report_to=[], disable_tqdm=True,
        use_cpu=True, dataloader_pin_memory=False, seed=0, roundpipe_devices="cpu", roundpipe_num_microbatches=2,
        roundpipe_async_optimizer=True, roundpipe_optimizer_placement="host")
    callback = _LookBeforeEachEvaluation()
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=train.select(range(8)),
                               eval_dataset=held_out.select(range(5)), callbacks=[callback] if look else None)
    callback.trainer = trainer
    try:
        with faults.injected(_slow_host_step):
            trainer.train()
    finally:
        trainer.roundpipe_engine.close()
    logs = trainer.state.log_history
    return [e["loss"] for e in logs if "loss" in e], [e["eval_loss"] for e in logs if "eval_loss" in e]


def test_the_trainers_evaluations_during_lagged_training_equal_those_after_a_look(tmp_path):
    losses, evaluations = _trainer_evaluations(tmp_path, look=False)
    looked_losses, looked_evaluations = _trainer_evaluations(tmp_path, look=True)
    assert losses == looked_losses  # looking changes no step ([Note: looking changes nothing])
    assert len(evaluations) == STEPS
    torch.testing.assert_close(evaluations, looked_evaluations, rtol=1e-12, atol=1e-12)
