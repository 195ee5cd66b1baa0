"""Memory of the chunked loss head: with a 32k vocabulary and 1k tokens per micro-batch, the peak memory of the
`CausalLMHead` layer (forward + backward on one micro-batch, as the engine builds it with its defaults) stays below
one full fp32 logits tensor of the micro-batch (1024 x 32000 x 4 bytes).

Measured, not estimated: the CPU allocator reports every allocation and free to the profiler when
`profile_memory=True`; replaying those events in order gives the peak of the bytes allocated during the call and
still alive (tensors that existed before it, such as the weights, are not counted; gradients created in it are).
The meter is checked on the unchunked computation, which must show at least one full logits tensor.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.models.head import CausalLMHead

try:
    from torch._C._profiler import _EventType
except ImportError:  # pragma: no cover - the meter needs the profiler's event tree
    _EventType = None

pytestmark = pytest.mark.skipif(_EventType is None, reason="this torch has no profiler event tree")

VOCAB = 32000
TOKENS = 1024
HIDDEN = 16
FULL_LOGITS_BYTES = TOKENS * VOCAB * 4


def peak_bytes(fn) -> int:
    """Peak of the bytes allocated by this thread during `fn()` and not yet freed, from the allocator's events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, -node.extra_fields.alloc_size, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    assert events, "the profiler recorded no allocation: the meter measures nothing"
    live = peak = 0
    for _, _, size in sorted(events):  # same-time events: allocations before frees (over-estimates, never under)
        live += size
        peak = max(peak, live)
    return peak


def build_head(dtype: torch.dtype):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))  # the engine's default head
    head = engine.layers[-1]
    assert isinstance(head, CausalLMHead)
    return engine, model, head


def micro_batch(engine, rows: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (rows, TOKENS // rows), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100
    _ids, *rest = engine.split.prepare_inputs(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels
    )
    hidden = torch.randn(rows, TOKENS // rows, HIDDEN, generator=generator).to(dtype).requires_grad_()
    return hidden, rest, labels


@pytest.mark.parametrize(
    ("dtype", "rows"), [(torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 1)], ids=["fp32", "fp32-4rows", "bf16"]
)
def test_loss_head_peak_memory_is_below_one_fp32_logits_tensor(dtype, rows):
    engine, model, head = build_head(dtype)
    hidden, rest, _labels = micro_batch(engine, rows, dtype)
    losses = []

    def forward_backward():
        loss = head(hidden, *rest)
        loss.backward()
        losses.append(loss.detach())

    peak = peak_bytes(forward_backward)
    engine.close()
    assert losses[0].isfinite() and hidden.grad is not None and model.lm_head.weight.grad is not None
    print(f"loss head peak ({dtype}, {rows} x {TOKENS // rows} tokens): {peak / 2**20:.1f} MiB; "
          f"full fp32 logits: {FULL_LOGITS_BYTES / 2**20:.1f} MiB")
    assert peak < FULL_LOGITS_BYTES, (
        f"loss head peak {peak / 2**20:.1f} MiB >= one full fp32 logits tensor ({FULL_LOGITS_BYTES / 2**20:.1f} MiB)"
    )


def test_the_meter_sees_the_full_logits_of_an_unchunked_head():
    """The same head computing the whole micro-batch's logits at once: the meter must report at least one full fp32
    logits tensor (and the chunked head's loss must be the same)."""
    engine, model, head = build_head(torch.float32)
    hidden, rest, labels = micro_batch(engine, 1, torch.float32)
    losses = []

    def unchunked():
        logits = head.logits(hidden).float()
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="sum")
        loss = loss / (shift != -100).sum()
        loss.backward()
        losses.append(loss.detach())

    peak = peak_bytes(unchunked)
    with torch.no_grad():
        chunked = head(hidden, *rest)
    engine.close()
    assert peak >= FULL_LOGITS_BYTES, f"the meter saw only {peak / 2**20:.1f} MiB for the unchunked head"
    torch.testing.assert_close(chunked, losses[0], rtol=1e-5, atol=0)
