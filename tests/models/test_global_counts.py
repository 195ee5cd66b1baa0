"""A wrapped HF model counts the label tokens (and, with a router aux loss, the non-padding tokens) its loss is
normalised by through the engine's gradient exchange ([Note: gradient exchange]): on one process (`NoExchange`) the
counts are its own batch's, and the loss is HF's; under data parallelism the same call sums them over the ranks. No
data-parallel branch decides whether to count."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.runtime.distribution import gradient_exchange as gradient_exchange_module

from split_helpers import MOE_FAMILIES, available_families, build_model, make_batch, reference_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared exchange helper
from exchange_helpers import RecordingExchange  # noqa: E402

COUNTS = "the all-reduce of the label and token counts of the global batch"


@pytest.mark.parametrize("family", ["llama"] + sorted(MOE_FAMILIES & set(available_families()))[:1])
def test_the_models_counts_go_through_the_engines_exchange(family, monkeypatch):
    exchange = RecordingExchange()
    # The one-process exchange `gradient_exchange()` builds, wherever the engine calls it from.
    monkeypatch.setattr(gradient_exchange_module, "NoExchange", lambda: exchange)
    model = build_model(family)
    batch = make_batch("left")
    expected = reference_loss(copy.deepcopy(model), batch)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        loss = engine.forward_backward(**batch)
    finally:
        engine.close()
    assert COUNTS in exchange.sums
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
