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
        assert f"efficiency at {gbit} Gb/s" in out


def test_ring_and_step_arithmetic_by_hand():
    assert sm.ring_bytes(1000, 1) == 0 and sm.ring_bytes(1000, 2) == 500 and sm.ring_bytes(1000, 4) == 750
    assert sm.step_bytes(10, 2) == (20, 10)  # 4 bytes of gradient and 2 of weight per parameter, half of each
    # 1e9 trainable parameters, 2 nodes, a link of 8 Gb/s at full rate = 1e9 bytes/s: the reduce-scatter sends
    # 2e9 bytes (2 s), the all-gather 1e9 (1 s). A 1.5 s GPU step hides 1 s of the first and 0.5 s of the second.
    assert sm.step_time(1.5, 0.0, 10**9, 2, 8, link_efficiency=1.0) == pytest.approx(1.5 + 1.0 + 0.5)
    assert sm.efficiency(1.5, 0.0, 10**9, 2, 8, link_efficiency=1.0) == pytest.approx(0.5)
    # A fast link hides everything; a host-bound step then gains from the host's work split over the nodes.
    assert sm.step_time(1.0, 3.0, 10**6, 4, 400) == pytest.approx(1.0)
    assert sm.efficiency(1.0, 3.0, 10**6, 4, 400) == pytest.approx(3.0)
    assert sm.efficiency(1.0, 0.5, 10**6, 16, 400) == pytest.approx(1.0)


def test_host_memory_splits_only_the_optimizer_state():
    full = sm.WORKLOADS[0]
    params = sm.total_params(full.arch)
    one, two = sm.host_gib_per_node(full, 1), sm.host_gib_per_node(full, 2)
    assert one * 2**30 == pytest.approx(18 * params)  # 2 + 4 + 12 bytes per parameter
    assert (one - two) * 2**30 == pytest.approx(6 * params)  # half of the 12 bytes of optimizer state


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
