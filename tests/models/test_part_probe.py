"""[Note: parts around the decoder layers]: the probe that orders the parts never runs a part after the layers
(a kernel of its own, such as Liger's Triton RMSNorm, would be launched on meta tensors and fault the GPU)."""

from __future__ import annotations

import torch
from torch import nn

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import build_model, make_batch, reference_loss, run_layers


class RefusesMeta(nn.Module):
    """The model's final norm, run only on real tensors (as a Triton kernel needs)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        DEVICES_SEEN.append(hidden.device.type)  # a kernel does not raise on meta tensors: it faults the GPU later
        return self.norm(hidden)


DEVICES_SEEN: list[str] = []  # module-level: the probe works on deep copies of the part


def test_a_final_norm_that_cannot_run_on_meta_tensors_splits_exactly():
    model = build_model("llama")
    DEVICES_SEEN.clear()
    model.model.norm = RefusesMeta(model.model.norm)
    batch = make_batch("right")
    expected = reference_loss(model, batch)
    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
    assert "meta" not in DEVICES_SEEN and DEVICES_SEEN
