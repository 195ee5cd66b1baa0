"""benchmarks/scaling_model.py: it runs, its arithmetic on a case small enough to do by hand, its parameter counts
against Hugging Face models built on the meta device, and docs/multi-node.md holds its current output."""

from __future__ import annotations

import pytest
import torch

from accelerate_roundpipe.plan.decoder_shapes import MODEL_SHAPES
from benchmarks import scaling_model as sm


def test_the_script_prints_one_row_per_workload_and_node_count(capsys):
    sm.main([])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| workload")]
    assert len(rows) == len(sm.WORKLOADS) * (1 + len(sm.NODES))
    for gbit in sm.LINKS_GBIT:
        assert f"efficiency at {gbit} Gb/s: as built / pipelined" in out


def test_ring_and_step_arithmetic_by_hand():
    assert sm.ring_bytes(1000, 1) == 0 and sm.ring_bytes(1000, 2) == 500 and sm.ring_bytes(1000, 4) == 750
    assert sm.step_bytes(10, 2) == (20, 20)  # 4 bytes of gradient and 4 of float32 weight per parameter, half each
    # 1e9 trainable parameters, 2 nodes, a link of 8 Gb/s at full rate = 1e9 bytes/s: the reduce-scatter and the
    # all-gather send 2e9 bytes each (2 s each). Pipelined, a 1.5 s GPU step hides 1 s of the first (under the
    # backward, 2/3) and 0.5 s of the second (under the next forward, 1/3).
    assert sm.step_time(1.5, 0.0, 10**9, 2, 8, sm.PIPELINED, link_efficiency=1.0) == pytest.approx(1.5 + 1.0 + 1.5)
    assert sm.efficiency(1.5, 0.0, 10**9, 2, 8, sm.PIPELINED, link_efficiency=1.0) == pytest.approx(1.5 / 4.0)
    # As built, the same link (slower than gloo's measured rate, so the link binds) and the serial collectives:
    # only the measured share of the 4 s hides.
    hidden = 0.2985 / 2.5058
    assert sm.step_time(1.5, 0.0, 10**9, 2, 8, sm.AS_BUILT, link_efficiency=1.0) == pytest.approx(
        1.5 + (1 - hidden) * 4.0)
    # A fast link hides everything pipelined; a host-bound step then gains from the host's work split over nodes.
    assert sm.step_time(1.0, 3.0, 10**6, 4, 400, sm.PIPELINED) == pytest.approx(1.0)
    assert sm.efficiency(1.0, 3.0, 10**6, 4, 400, sm.PIPELINED) == pytest.approx(3.0)
    assert sm.efficiency(1.0, 0.5, 10**6, 16, 400, sm.PIPELINED) == pytest.approx(1.0)


def test_as_built_is_capped_by_gloo_on_fast_links():
    # gloo's 8-stream algorithm bandwidth between two processes, 3.785 / 5.582 GB/s of buffer: each process sent
    # half of that. A 400 Gb/s link at 80% (40 GB/s) is far faster, so the cap binds.
    reduce_rate, gather_rate = sm.transport_rates(400, sm.AS_BUILT, streams=8)
    assert (reduce_rate, gather_rate) == pytest.approx((3.785e9 / 2, 5.582e9 / 2))
    assert sm.transport_rates(400, sm.PIPELINED) == pytest.approx((40e9, 40e9))
    assert sm.transport_rates(8, sm.AS_BUILT, link_efficiency=1.0) == pytest.approx((1e9, 1e9))  # the link binds
    # 3 streams: the largest measured count not above it is 2.
    assert sm.gloo_send_rates(3) == pytest.approx((2.298e9 / 2, 1.542e9 / 2))
    reduce_s, gather_s = sm.collective_seconds(10**9, 2, 400, sm.AS_BUILT, streams=1)
    assert (reduce_s, gather_s) == pytest.approx((2e9 / (1.463e9 / 2), 2e9 / (0.832e9 / 2)))
    # Then faster links change nothing as built, while they do pipelined.
    gpu_s, host_s, trainable = 0.8, 0.96, 10**10

    def at(gbit, variant):
        return sm.efficiency(gpu_s, host_s, trainable, 2, gbit, variant)

    assert at(100, sm.AS_BUILT) == at(400, sm.AS_BUILT)
    assert at(100, sm.PIPELINED) < at(400, sm.PIPELINED)


def test_streams_follow_the_engines_chunking():
    from accelerate_roundpipe.runtime.distribution import gloo_exchange

    assert sm.COLLECTIVE_STREAMS == gloo_exchange.COLLECTIVE_STREAMS
    minimum = gloo_exchange.MIN_STREAM_ELEMENTS
    assert sm.collective_streams(16 * minimum, 2) == 8  # 8 minimum-size chunks per rank and more
    assert sm.collective_streams(6 * minimum, 2) == 3
    assert sm.collective_streams(minimum, 2) == 1
    qwen_layer = sm.layer_bucket_params(sm.WORKLOADS[0])
    shape = sm.SHAPES["qwen3-1.7b"]
    assert qwen_layer * shape.num_hidden_layers + shape.vocab_size * shape.hidden_size + shape.hidden_size \
        == sm.total_params("qwen3-1.7b")  # the layers' buckets, the (tied) embedding and the final norm
    lora = sm.WORKLOADS[1]
    assert sm.layer_bucket_params(lora) * sm.SHAPES[lora.arch].num_hidden_layers == sm.trainable_params(lora)


def test_measured_inputs_are_the_records():
    import json
    import os

    results = os.path.join(os.path.dirname(sm.DOC), os.pardir, "benchmarks", "results")
    with open(os.path.join(results, "gloo_h200_2026-12-01.jsonl"), encoding="utf-8") as f:
        gloo = {r["streams"]: r for r in map(json.loads, f)}
    for streams, (reduce_gb_s, gather_gb_s) in sm.GLOO_ALGBW_GB_S.items():
        assert gloo[streams]["world_size"] == sm.GLOO_WORLD
        assert gloo[streams]["reduce_scatter_gb_s"] == pytest.approx(reduce_gb_s, rel=1e-3), streams
        assert gloo[streams]["all_gather_gb_s"] == pytest.approx(gather_gb_s, rel=1e-3), streams
    with open(os.path.join(results, "dp_h200_2026-12-01_63cacc9.jsonl"), encoding="utf-8") as f:
        rank0 = next(r for r in map(json.loads, f) if r["rank"] == 0)
    assert rank0["collective_s"] == pytest.approx(sm.SMOKE_COLLECTIVE_S, rel=1e-3)
    assert rank0["collective_hidden_s"] == pytest.approx(sm.SMOKE_HIDDEN_S, rel=1e-3)


def test_pipelined_never_slower_than_as_built():
    for w in sm.WORKLOADS:
        gpu_s, host_s, _ = sm.one_node_times(w)
        for n in sm.NODES:
            streams = sm.collective_streams(sm.layer_bucket_params(w), n)
            for gbit in sm.LINKS_GBIT:
                built = sm.step_time(gpu_s, host_s, sm.trainable_params(w), n, gbit, sm.AS_BUILT, streams)
                assert sm.step_time(gpu_s, host_s, sm.trainable_params(w), n, gbit, sm.PIPELINED) <= built


def test_host_memory_is_the_stores_on_one_node_and_splits_only_adams_state():
    import torch

    from accelerate_roundpipe.runtime.state.host_budget import store_bytes

    def fp32(dtype):
        return torch.float32

    frozen, trainable = 3 * 10**6, 10**6
    one_node = store_bytes([(frozen, torch.bfloat16, False), (trainable, torch.bfloat16, True)], fp32)
    assert sm.host_bytes_per_node(frozen + trainable, trainable, 1) == one_node
    # N > 1: the optimizer copy and gradient stay whole (8 bytes); AdamW's moments (8) and the reduced gradient's
    # range (4) split.
    assert sm.host_bytes_per_node(10, 10, 2) == 10 * 2 + 10 * 8 + 10 * 12 / 2
    full = sm.WORKLOADS[0]
    params = sm.total_params(full.arch)
    assert sm.host_gib_per_node(full, 1) * 2**30 == pytest.approx(18 * params)


def test_shapes_match_the_planner_and_count_like_hugging_face():
    for arch, shape in sm.SHAPES.items():
        assert shape == MODEL_SHAPES[arch], arch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    for arch, config_cls, model_cls in (("qwen3-1.7b", Qwen3Config, Qwen3ForCausalLM),
                                        ("qwen3-32b", Qwen3Config, Qwen3ForCausalLM),
                                        ("llama3.1-8b", LlamaConfig, LlamaForCausalLM)):
        s = sm.SHAPES[arch]
        config = config_cls(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                            num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                            num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
                            tie_word_embeddings=s.tie_word_embeddings)
        with torch.device("meta"):
            model = model_cls(config)
        counted = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
        assert sm.total_params(arch) == counted, arch


def test_the_doc_holds_the_current_tables():
    with open(sm.DOC, encoding="utf-8") as f:
        block = sm.doc_block(f.read())
    assert block == sm.tables(), "docs/multi-node.md is stale: run `python -m benchmarks.scaling_model --write`"
