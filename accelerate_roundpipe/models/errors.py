"""The error raised when a model cannot be turned into pipeline layers."""

from .model_kind import WHAT_ROUNDPIPE_TRAINS, not_a_causal_lm

WAY_OUT = (
    "To run this model anyway, build its layer list yourself (each layer takes the previous layer's tensors and the "
    "last one returns the micro-batch loss) and pass that `torch.nn.Sequential` to `RoundPipe` directly."
)


class UnsupportedModelError(ValueError):
    """`split_causal_lm` cannot split this model; the message names the missing piece and the way out, after what
    RoundPipe trains when the model is not a decoder-only causal LM ([Note: causal LMs only] in `model_kind.py`)."""

    def __init__(self, model: object, problem: str):
        # A problem that is itself a sentence (e.g. with the integrations' advice appended) keeps one full stop.
        self.problem = problem.rstrip(".")
        name = type(model).__name__
        kind = not_a_causal_lm(model)
        lead = f"{WHAT_ROUNDPIPE_TRAINS}, and {name} is {kind}. " if kind else ""
        super().__init__(f"{lead}Cannot split {name} into pipeline layers: {self.problem}. {WAY_OUT}")
