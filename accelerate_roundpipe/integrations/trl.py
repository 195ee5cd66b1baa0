"""TRL's `SFTTrainer`, `DPOTrainer`, `KTOTrainer` and `GRPOTrainer` on RoundPipe: `RoundPipeSFTTrainer`,
`RoundPipeDPOTrainer`, `RoundPipeKTOTrainer`, `RoundPipeGRPOTrainer`.

    from accelerate_roundpipe.integrations.trl import RoundPipeSFTTrainer   # same arguments as trl.SFTTrainer
    trainer = RoundPipeSFTTrainer(model=model, args=SFTConfig(...), train_dataset=..., processing_class=tokenizer)

Each class is TRL's trainer with `RoundPipeTrainer` under it (`class RoundPipeSFTTrainer(SFTTrainer,
RoundPipeTrainer)`), which is also what the stock-script launcher makes of an unmodified TRL script: TRL's trainers
subclass `transformers.Trainer`, which the launcher has swapped for `RoundPipeTrainer` before TRL is imported.

What makes TRL work on the engine:
- TRL's loss needs per-token log-probabilities, which it asks for with `model(..., fused_lm_head=True)`; the
  RoundPipe model answers that call from the pipeline's head ([Note: per-token fields] in `models/token_fields.py`),
  and TRL's loss, computed on the host from them, back-propagates through the backward pipeline;
- a DPO or KTO reference model is put on RoundPipe too, frozen (`RoundPipeTrainer._is_auxiliary_model`): its
  weights stay in host memory as compute copies only, with no optimizer copy or gradient buffer, and stream to the
  same devices as the policy's, so a reference as large as the policy needs no GPU memory of its own;
- GRPO's completions come from `model.generate`, which runs through the pipeline without a KV cache (each new token
  recomputes the whole sequence, every layer's weights streamed again): exact, and slow for long completions;
- a PEFT policy without a reference model works as in TRL: the reference log-probabilities come with the adapters
  disabled, a switch the devices' layer copies follow ([Note: adapter switches] in
  `runtime/execution/adapter_switches.py`).

`trl` is imported when a class is first used, so this module imports without TRL installed.
"""

from __future__ import annotations

import functools

_TRL_TRAINERS = {"RoundPipeSFTTrainer": "SFTTrainer", "RoundPipeDPOTrainer": "DPOTrainer",
                 "RoundPipeKTOTrainer": "KTOTrainer", "RoundPipeGRPOTrainer": "GRPOTrainer"}
__all__ = list(_TRL_TRAINERS)


def __getattr__(name: str):
    if name not in _TRL_TRAINERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _roundpipe_trl_trainer(_TRL_TRAINERS[name])


@functools.cache
def _roundpipe_trl_trainer(trl_name: str) -> type:
    try:
        import trl  # noqa: F401 - imported here for the error below; the class comes through compat
    except ImportError as error:
        raise ImportError(
            f"RoundPipe{trl_name} needs TRL: `pip install trl` (or `pip install accelerate-roundpipe[test]`)."
        ) from error
    from ..compat.trl_internals import trl_trainer
    from .trainer import RoundPipeTrainer

    base = trl_trainer(trl_name, RoundPipeTrainer.__bases__[0], RoundPipeTrainer)  # [Note: compatibility reaches]
    doc = (
        f"`trl.{trl_name}` whose model (and reference model) runs on RoundPipe. Takes the same arguments; "
        f"RoundPipe settings come from `ROUNDPIPE_*` or `roundpipe_*` fields of a `RoundPipeTrainingArguments` "
        f"(see accelerate_roundpipe.integrations.trl)."
    )
    # Under the launcher `base` already sits on RoundPipeTrainer; listing it again keeps the same order.
    return type(f"RoundPipe{trl_name}", (base, RoundPipeTrainer), {"__doc__": doc, "__module__": __name__})
