"""Our engine three ways in over the same batch: the engine API, a stock Accelerate loop and `RoundPipeTrainer`.

Each runner takes a model built by the caller (put on RoundPipe in place: give each runner its own copy), a
`RoundPipeConfig`, a batch of CPU tensors (`input_ids`, `attention_mask`, `labels`, rows x seq), the warm-up and
timed step counts and the learning rate, and returns `common.run_result`'s dict.

What is held equal so that the three tokens/s compare (the Trainer's choices, copied into the two loops):
- the same rows every step, one `forward_backward` per step over all of them (no gradient accumulation), the
  micro-batch count of `config` (the Trainer gets it as `roundpipe_*` training arguments, the Accelerate loop as a
  `RoundPipePlugin`, the engine directly), and its optimizer mode (`async_optimizer`, from the environment too);
- torch's fused CPU AdamW, betas (0.9, 0.999), eps 1e-8, weight decay 0, a constant learning rate (what
  `optim="adamw_torch_fused"` with the Trainer's defaults and `lr_scheduler_type="constant"` builds), stepped by the
  engine; the loops never clip, the Trainer clips at its `max_grad_norm` (0: it measures the norm it logs on the
  optimizer thread, one step late, which is part of its path);
- the loss read on the host every step (`loss.item()`): the Trainer does that itself (its NaN filter), so the two
  loops do it too; the Trainer also logs every `logging_steps`;
- compute dtype: the model's own. A bfloat16 model gets `mixed_precision="bf16"` / `bf16=True` on the integration
  paths, which means bfloat16 compute copies with float32 optimizer copies there, as the engine does for it.
"""

from benchmarks.runners.accelerate_loop import run_accelerate_loop
from benchmarks.runners.engine import run_engine
from benchmarks.runners.trainer import run_trainer

RUNNERS = {"roundpipe-engine": run_engine, "roundpipe-accelerate-loop": run_accelerate_loop,
           "roundpipe-trainer": run_trainer}
