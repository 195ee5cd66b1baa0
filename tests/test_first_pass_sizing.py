"""[Note: first-pass micro-batches]: the estimate of one layer's transient per row from a config, the count chosen
from it, and the start summary's words for it."""

from __future__ import annotations

import dataclasses

import transformers

from accelerate_roundpipe.config import RoundPipeConfig
from accelerate_roundpipe.plan.activation_estimate import SCORE_COPIES, row_activations
from accelerate_roundpipe.plan.first_pass_sizing import size_first_pass
from accelerate_roundpipe.runtime.execution.measured_plan import MICROBATCH_CHOICES
from accelerate_roundpipe.runtime.execution.microbatches import MicrobatchPolicy
from accelerate_roundpipe.telemetry.engine_view import DeviceView, EngineSnapshot, StoreView
from accelerate_roundpipe.telemetry.summary import engine_summary


def gpt_oss_config(heads: int = 4):
    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=heads, num_key_value_heads=2, head_dim=8,
                                       num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
    config._attn_implementation = "eager"  # as GptOssForCausalLM resolves it (no sdpa for its sinks)
    return config


def qwen3_config():
    config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    config._attn_implementation = "sdpa"
    return config


def test_eager_scores_scale_with_heads_and_the_square_of_the_length():
    small = row_activations(gpt_oss_config(heads=4), seq_len=64, element_size=2)
    longer = row_activations(gpt_oss_config(heads=4), seq_len=128, element_size=2)
    wider = row_activations(gpt_oss_config(heads=8), seq_len=64, element_size=2)
    assert small.scores_bytes == 4 * 64 * 64 * 2 * SCORE_COPIES
    assert longer.scores_bytes == 4 * small.scores_bytes
    assert wider.scores_bytes == 2 * small.scores_bytes
    assert small.experts and small.mlp_bytes == 64 * 2 * (4 * 16 + 2 * 32) * 2  # tokens x top_k x expert widths
    part, _ = row_activations(gpt_oss_config(), seq_len=4096, element_size=2).largest_part()
    assert part == "eager attention's scores"


def test_sdpa_has_no_score_term():
    estimate = row_activations(qwen3_config(), seq_len=4096, element_size=2)
    assert estimate.scores_bytes == 0 and not estimate.experts
    assert estimate.mlp_bytes == 4096 * 64 * 4 * 2
    assert estimate.hidden_bytes > 0


def fits_one_row_not_four(per_row) -> float:
    return 1.5 * per_row.total_bytes


def test_a_budget_for_one_row_runs_one_row_per_micro_batch():
    per_row = row_activations(gpt_oss_config(), seq_len=4096, element_size=2)
    sizing = size_first_pass(per_row, rows=8, seq_len=4096, default_count=2,
                             free_bytes=fits_one_row_not_four(per_row), choices=MICROBATCH_CHOICES)
    assert sizing.count == 8 and sizing.raised
    assert sizing.micro_batch_bytes() == per_row.total_bytes


def test_the_default_stays_when_everything_fits():
    per_row = row_activations(gpt_oss_config(), seq_len=4096, element_size=2)
    sizing = size_first_pass(per_row, rows=8, seq_len=4096, default_count=2, free_bytes=2**50,
                             choices=MICROBATCH_CHOICES)
    assert sizing.count == 2 and not sizing.raised


class FixedBudgetSizer:
    """A `FirstPassSizer` over a GPT-OSS-like config with a given room, for the policy alone."""

    def __init__(self, free_bytes: float) -> None:
        self.free_bytes = free_bytes

    def size(self, rows, seq_len, default_count):
        per_row = row_activations(gpt_oss_config(), seq_len, 2)
        return size_first_pass(per_row, rows, seq_len, default_count, self.free_bytes, MICROBATCH_CHOICES)


class NoPlanYet:
    chosen_microbatches = None


def test_the_policy_sizes_unplanned_passes_and_the_users_setting_wins():
    per_row = row_activations(gpt_oss_config(), seq_len=4096, element_size=2)
    sizer = FixedBudgetSizer(fits_one_row_not_four(per_row))
    policy = MicrobatchPolicy(RoundPipeConfig(devices=["cpu"]), 1, NoPlanYet(), False, sizer)
    assert policy.count_for(8, 4096) == 8
    assert policy.count_for(8) == 2  # no length known: the default
    roomy = MicrobatchPolicy(RoundPipeConfig(devices=["cpu"]), 1, NoPlanYet(), False, FixedBudgetSizer(2**50))
    assert roomy.count_for(8, 4096) == 2
    user = MicrobatchPolicy(RoundPipeConfig(devices=["cpu"], num_microbatches=4), 1, NoPlanYet(), False, sizer)
    assert user.count_for(8, 4096) == 4 and user.sizing is None


def _snapshot(plan: str, sizing) -> EngineSnapshot:
    return EngineSnapshot(devices=(DeviceView("cuda:0", True, True),), layers=4, plan=plan, partition="F[] B[]",
                          num_microbatches=None, microbatches_per_round=None, recompute="stage", trace_path=None,
                          optimizer=None, placement=None, data_parallel=None,
                          store=StoreView(0, 0, ("bfloat16",), (), False), first_pass=sizing)


def test_the_summary_says_why_the_first_pass_has_more_micro_batches():
    per_row = dataclasses.replace(row_activations(gpt_oss_config(), seq_len=4096, element_size=2),
                                  scores_bytes=2 * 2**30, mlp_bytes=0, hidden_bytes=0)
    sizing = size_first_pass(per_row, rows=8, seq_len=4096, default_count=2, free_bytes=3.0 * 2**30,
                             choices=MICROBATCH_CHOICES)
    text = engine_summary(_snapshot("measured", sizing))
    assert ("micro-batches: 8 per pass on the first pass (eager attention's scores: 2.000 GiB a row per layer, "
            "2.000 GiB in all, against 3.000 GiB free), then the measured plan's choice") in text
    static = engine_summary(_snapshot("static", sizing))
    assert "micro-batches: 8 per pass for 8 rows of 4096 tokens (eager attention's scores" in static
    unraised = dataclasses.replace(sizing, count=2)
    assert "2 per pass (2 x devices) on the first pass" in engine_summary(_snapshot("measured", unraised))


def test_a_shape_is_sized_once_and_the_host_memory_read_once(monkeypatch):
    """Every unplanned pass asks for its count (a static plan's every pass): the count of one batch shape must not
    move with the host's free memory between passes, and the host's memory is not read again on every pass."""
    from types import SimpleNamespace

    from accelerate_roundpipe.runtime.execution import first_pass

    reads = []
    free = iter([2 ** 40, 1])  # a roomy host, then one with no memory left: the second read must never happen

    def available():
        reads.append(1)
        return next(free)

    monkeypatch.setattr(first_pass, "available_memory_bytes", available)
    store = SimpleNamespace(buckets=[], window_bytes=lambda layers, grads=False: 0,  # no weights to subtract
                            saved_input_buffers=None)
    partition = SimpleNamespace(forward=(SimpleNamespace(layers=range(2)),), backward=())
    sizer = first_pass.FirstPassSizer(gpt_oss_config(), store, SimpleNamespace(budget_bytes=None), partition)
    counts = [sizer.size(8, 64, 2).count for _ in range(3)]
    counts.append(sizer.size(4, 64, 2).count)  # another shape: sized anew, against the memory first read
    assert counts == [2, 2, 2, 2]
    assert len(reads) == 1
