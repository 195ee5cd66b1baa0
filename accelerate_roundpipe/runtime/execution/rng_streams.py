"""The RNG seed of each layer run: one stream per (pass, layer, micro-batch), so a forward and its recomputation draw
the same masks whatever device or thread runs them."""

from __future__ import annotations


def stream_seed(base_seed: int, pass_index: int, layer_index: int, microbatch_index: int) -> int:
    """The RNG seed of one layer on one micro-batch of one pass: the forward and its recomputation draw the same
    masks whatever device or thread runs them.

    [Note: RNG streams of passes]
    `pass_index` is the pass's `rng_stream`, not its pass number: training passes (the module in training mode)
    count 0, 1, 2, ... on their own and evaluation passes count -1, -2, ... apart, so an evaluation forward between
    training steps changes no later dropout mask, as in plain PyTorch, where an eval-mode forward draws nothing.
    A training-mode forward without gradients (generation in training mode) counts as a training pass: in plain
    PyTorch its draws move the generator too. Both counts are in `engine_state()`, so a resume draws on exactly.
    """
    value = base_seed & 0xFFFFFFFFFFFF
    for part in (pass_index, layer_index, microbatch_index):
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value
