"""The head split into vocabulary shards ([Note: vocabulary shards]): loss, eval logits and every gradient equal
plain HF's in float64, tied and untied, with a bias, label padding and ignore_index, layer by layer and on the engine
with 1-3 CPU workers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.models import split_causal_lm
from accelerate_roundpipe.models.vocab_shards import VocabShard, shard_bounds
from accelerate_roundpipe.runtime.devices.device import Device
from accelerate_roundpipe.runtime.state.host_store import Bucket

from split_helpers import (
    VOCAB,
    assert_close,
    assert_same_gradients,
    build_model,
    gradients,
    make_batch,
    reference_loss,
    run_layers,
)


def with_head_bias(model):
    """The lm_head with a random bias (no HF family in the tests has one; the shards slice it too)."""
    old = model.lm_head
    model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.copy_(0.5 * torch.randn(old.out_features, generator=torch.Generator().manual_seed(2),
                                                   dtype=old.weight.dtype))
    return model


def hf_reference(model, batch):
    ref = copy.deepcopy(model)
    loss = reference_loss(ref, batch)
    loss.backward()
    return loss.detach(), gradients(ref)


def without_labels(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_shard_bounds_cover_the_vocabulary_evenly():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(128, 1) == [(0, 128)]
    with pytest.raises(ValueError, match="head_shards must be between 1 and the vocabulary size"):
        shard_bounds(4, 5)


@pytest.mark.parametrize("shards", [2, 3, 7])
@pytest.mark.parametrize("variant", ["untied", "tied", "bias"])
@pytest.mark.parametrize("padding", ["left", "right", "mixed", "none"])
def test_layers_match_hf_loss_gradients_and_logits(shards, variant, padding):
    model = build_model("llama", tie_word_embeddings=variant == "tied")
    if variant == "bias":
        model = with_head_bias(model)
    batch = make_batch(padding)
    expected, expected_grads = hf_reference(model, batch)

    # 5-token loss chunks: several chunks per shard, in forward and in the recomputing backward.
    split = split_causal_lm(model, head_shards=shards, loss_chunk_tokens=5)
    assert [type(layer) for layer in split.layers[-shards:]] == [VocabShard] * shards
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()
    assert_close(loss, expected, "loss")
    assert_same_gradients(gradients(model), expected_grads)
    if variant == "tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight

    model.eval()
    with torch.no_grad():
        logits = run_layers(split.layers, split.prepare_inputs(**without_labels(batch)))
        assert_close(logits, model(**without_labels(batch)).logits, "logits")


def test_every_label_ignored_gives_zero_loss_and_zero_gradients():
    model = build_model("qwen3")
    batch = make_batch("right")
    batch["labels"] = torch.full_like(batch["labels"], -100)
    split = split_causal_lm(model, head_shards=3)
    loss = run_layers(split.layers, split.prepare_inputs(**batch, num_items_in_batch=1))
    loss.backward()
    assert loss.item() == 0.0
    assert all(g.abs().max() == 0 for g in gradients(model).values())


def test_num_items_in_batch_is_the_divisor():
    model = build_model("llama")
    batch = make_batch("mixed")
    count = (batch["labels"][:, 1:] != -100).sum()
    split = split_causal_lm(model, head_shards=4)
    default = run_layers(split.layers, split.prepare_inputs(**batch))
    given = run_layers(split.layers, split.prepare_inputs(**batch, num_items_in_batch=3 * count))
    assert_close(given, default / 3, "loss with num_items_in_batch")


def test_router_aux_loss_on_the_last_shard():
    model = build_model("qwen3_moe")
    batch = make_batch("left")
    expected, expected_grads = hf_reference(model, batch)
    split = split_causal_lm(model, head_shards=3)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()
    assert_close(loss, expected, "loss with router aux")
    assert_same_gradients(gradients(model), expected_grads)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_matches_hf_on_cpu_workers(num_devices, tied):
    model = build_model("llama", tie_word_embeddings=tied)
    batch = make_batch("mixed")
    ref_loss, ref_grads = hf_reference(model, batch)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref_logits = ref(**without_labels(batch)).logits
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * num_devices, num_microbatches=3, head_shards=3))
    try:
        assert engine.partition.num_layers == 1 + model.config.num_hidden_layers + 3
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        assert_close(loss, ref_loss, "loss")
        for name, p in engine.named_parameters():
            assert_close(p.grad, ref_grads[name], f"grad of {name}")
        model.eval()
        with torch.no_grad():
            out = model(**batch)
        assert_close(out.logits, ref_logits, "eval logits")
        assert_close(out.loss, ref_loss, "eval loss", rtol=1e-6)  # the eval loss comes from the logits in fp32
    finally:
        engine.close()


@pytest.mark.parametrize("tied", [False, True])
def test_each_shard_moves_only_its_rows(monkeypatch, tied):
    """[Note: row windows]: with one shard per stage, every upload of the head weight is one shard's rows (or, tied,
    the embedding's whole weight) and every gradient it sends back is those rows; the gradients stay HF's."""
    model = build_model("llama", tie_word_embeddings=tied)
    batch = make_batch("mixed")
    _, ref_grads = hf_reference(model, batch)
    uploads, commits = [], []
    real_upload, real_commit = Device.upload_params_into, Bucket.commit

    def upload(self, flats, hosts):
        uploads.extend((h.data_ptr(), h.numel()) for h in hosts)
        return real_upload(self, flats, hosts)

    def commit(self, grad, grad_sq=None, window=None, used=None):
        commits.append((self.index, window or (0, self.grad.numel())))
        return real_commit(self, grad, grad_sq, window, used)

    monkeypatch.setattr(Device, "upload_params_into", upload)
    monkeypatch.setattr(Bucket, "commit", commit)
    below = 1 + model.config.num_hidden_layers  # the embedding and the decoder layers
    config = RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, head_shards=4,
                             forward_stages=[below, 1, 1, 1], backward_stages=[below, 1, 1, 1, 1])
    engine = wrap_model(model, config)
    try:
        store = engine._store
        head, _ = store.bucket_of[id(model.lm_head.weight)]
        bucket = store.buckets[head]
        row = model.config.hidden_size
        first = 1 + model.config.num_hidden_layers
        bounds = [(start * row, stop * row) for start, stop in shard_bounds(VOCAB, 4)]
        assert [store.window(range(first + k, first + k + 1), head) for k in range(4)] == bounds
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        base, esize = bucket.compute.data_ptr(), bucket.compute.element_size()
        head_uploads = [((ptr - base) // esize, (ptr - base) // esize + numel) for ptr, numel in uploads
                        if base <= ptr < base + bucket.compute.numel() * esize]
        whole = (0, bucket.compute.numel())
        allowed = set(bounds) | ({whole} if tied else set())
        assert head_uploads and set(head_uploads) <= allowed, head_uploads
        assert set(bounds) <= set(head_uploads)
        head_commits = [w for index, w in commits if index == head]
        assert set(head_commits) <= allowed and set(bounds) <= set(head_commits), head_commits
        assert torch.isfinite(loss)
        for name, p in engine.named_parameters():
            assert_close(p.grad, ref_grads[name], f"grad of {name}")
    finally:
        engine.close()


def test_engine_spreads_the_shards_over_several_stages():
    """Two CPU workers, static unit-cost plan: each shard is a layer like any other, so the head's shards land in
    different backward stages (with one head layer they could not)."""
    model = build_model("llama")
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, head_shards=4))
    try:
        first_shard = 1 + model.config.num_hidden_layers
        head_stages = [s for s in engine.partition.backward if s.stop > first_shard]
        assert len(head_stages) >= 2, str(engine.partition)
    finally:
        engine.close()


def test_what_cannot_be_split_says_so():
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM cannot .* transforms the logits.*head_shards=1"):
        split_causal_lm(build_model("gemma2"), head_shards=2)  # final logit soft-capping
    model = build_model("llama")
    split = split_causal_lm(model, head_shards=2)
    with pytest.raises(NotImplementedError, match="per-token fields.*head_shards=1"):
        run_layers(split.layers, split.prepare_inputs(**make_batch("right"), token_fields=True))
    with pytest.raises(ValueError, match="head_shards"):
        split_causal_lm(build_model("llama"), head_shards=VOCAB + 1)
    for bad in (0, "two", 1.5):
        with pytest.raises(ValueError, match="ROUNDPIPE_HEAD_SHARDS.*'auto'"):
            RoundPipeConfig(head_shards=bad)


def test_auto_picks_the_planners_count_from_the_models_flops(monkeypatch):
    """`head_shards="auto"`: the planner's count from the config's FLOPs for the devices in use; 1 on one device.
    The same count as `head_shards_for` on the published Qwen3-1.7B shape (8 shards on 8 devices)."""
    from accelerate_roundpipe.models.vocab_shards import resolve_head_shards
    from accelerate_roundpipe.plan.decoder_shapes import MODEL_SHAPES
    from accelerate_roundpipe.plan.head_split import head_shards_for
    from accelerate_roundpipe.plan.shape_costs import shape_from_config

    assert head_shards_for(MODEL_SHAPES["qwen3-1.7b"], 8, 16) == 8
    assert head_shards_for(MODEL_SHAPES["qwen3-1.7b"], 1, 16) == 1
    model = build_model("llama", vocab_size=VOCAB * 64)  # a head of 8192 rows: several decoder layers' FLOPs
    assert shape_from_config(model.config).vocab_size == VOCAB * 64
    expected = head_shards_for(shape_from_config(model.config), 3, 6)
    assert expected > 1
    assert resolve_head_shards(RoundPipeConfig(devices=["cpu"] * 3, head_shards="AUTO"), model.config) == expected
    assert resolve_head_shards(RoundPipeConfig(devices=["cpu"], head_shards="auto"), model.config) == 1
    assert resolve_head_shards(RoundPipeConfig(devices=["cpu"]), model.config) == 1
    monkeypatch.setenv("ROUNDPIPE_HEAD_SHARDS", "auto")
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=3))
    try:
        assert sum(isinstance(layer, VocabShard) for layer in engine.split.layers) == expected
        batch = make_batch("left")
        loss = engine.forward_backward(**batch)
        assert torch.isfinite(loss)
    finally:
        engine.close()
