"""What the docs say of the Trainer's `grad_norm` without clipping (docs/ways-in.md, docs/troubleshooting.md): with
the exact step (the default) the norm logged at step k is step k-1's, the first step logs none
([Note: late grad norm])."""

from __future__ import annotations

import pytest
from integration_unit_helpers import lm_batch, tiny_llama, twin


def _logged_norms(trainer_class, args_class, model, tmp_path, **roundpipe) -> list:
    from transformers import TrainerCallback

    logged = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs.get("grad_norm"))

    rows = [{k: v[i] for k, v in lm_batch(rows=16, seed=3).items()} for i in range(16)]
    args = args_class(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                      max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                      seed=0, use_cpu=True, **roundpipe)
    trainer = trainer_class(model=model, args=args, train_dataset=rows, callbacks=[Record()])
    trainer.train()
    engine = getattr(trainer, "roundpipe_engine", None)
    if engine is not None:
        engine.close()
    return logged


def test_without_clipping_the_logged_norm_is_the_previous_steps(tmp_path):
    from transformers import Trainer, TrainingArguments

    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    model = tiny_llama()
    plain = _logged_norms(Trainer, TrainingArguments, twin(model), tmp_path / "plain")
    ours = _logged_norms(RoundPipeTrainer, RoundPipeTrainingArguments, model, tmp_path / "ours",
                         roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=2, roundpipe_summary=False)
    assert len(plain) == len(ours) == 4 and None not in plain
    assert ours[0] is None  # the first step logs none
    assert ours[1:] == pytest.approx(plain[:-1], rel=1e-4)  # step k logs step k-1's norm
