"""The error raised when a model cannot be turned into pipeline layers."""

WAY_OUT = (
    "To run this model anyway, build its layer list yourself (each layer takes the previous layer's tensors and the "
    "last one returns the micro-batch loss) and pass that `torch.nn.Sequential` to `RoundPipe` directly."
)


class UnsupportedModelError(ValueError):
    """`split_causal_lm` cannot split this model; the message names the missing piece and the way out."""

    def __init__(self, model: object, problem: str):
        # A problem that is itself a sentence (e.g. with the integrations' advice appended) keeps one full stop.
        self.problem = problem.rstrip(".")
        super().__init__(f"Cannot split {type(model).__name__} into pipeline layers: {self.problem}. {WAY_OUT}")
