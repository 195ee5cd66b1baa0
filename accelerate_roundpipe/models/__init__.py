"""Turn a model into the layer list the engine runs.

`split_causal_lm(model)` cuts a Hugging Face decoder-only causal LM (optionally wrapped in PEFT) into
`embeddings -> decoder layers -> norm + lm_head + loss`; any other model can be given to the engine as a plain
`torch.nn.Sequential`. transformers and peft are only imported by the model code itself, never here.
"""

from .causal_lm import CausalLMRoundPipe, wrap_model
from .errors import UnsupportedModelError
from .registry import FamilySpec, register_family
from .split import DecoderSplit, split_causal_lm

__all__ = [
    "CausalLMRoundPipe",
    "wrap_model",
    "DecoderSplit",
    "FamilySpec",
    "UnsupportedModelError",
    "register_family",
    "split_causal_lm",
]
