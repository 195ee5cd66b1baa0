"""Layers can be deep-copied per device, hold only their own parts of the model, and run concurrently."""

import copy
import threading

import pytest
import torch
from torch import nn

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import assert_close, available_families, build_model, make_batch, run_layers


def _reachable(root, stop=(type, torch.Tensor)):
    """Objects reachable from `root` through attributes and containers (not through classes, functions, tensors)."""
    seen, stack = {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, stop) or callable(obj) and not isinstance(obj, nn.Module):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return seen


@pytest.mark.parametrize("family", available_families())
def test_layers_hold_no_reference_to_the_whole_model(family):
    model = build_model(family)
    split = split_causal_lm(model)
    forbidden = {id(model): "the model", id(model.model): "the inner model", id(model.model.layers): "the layer list"}
    for index, layer in enumerate(split.layers):
        reachable = _reachable(layer)
        leaks = [name for key, name in forbidden.items() if key in reachable]
        assert not leaks, f"layer {index} ({type(layer).__name__}) reaches {leaks}"
        own_decoder_layers = [m for m in model.model.layers if id(m) in reachable]
        assert len(own_decoder_layers) == (1 if 0 < index < len(split.layers) - 1 else 0)


def test_peft_layers_hold_no_reference_to_the_whole_model():
    peft = pytest.importorskip("peft")
    base = build_model("llama")
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0))
    split = split_causal_lm(peft_model)
    forbidden = {id(peft_model), id(peft_model.base_model), id(base), id(base.model)}
    for index, layer in enumerate(split.layers):
        assert not forbidden & _reachable(layer).keys(), f"layer {index} reaches the PEFT or base model"


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_deep_copies_compute_the_same(family):
    model = build_model(family)
    split = split_causal_lm(model)
    inputs = split.prepare_inputs(**make_batch("right"))
    expected = run_layers(split.layers, inputs)

    full_copies = nn.Sequential(*(copy.deepcopy(layer) for layer in split.layers))
    assert_close(run_layers(full_copies, inputs), expected, "loss of deep copies")

    # What the engine does: copy the modules, keep the Parameter objects (it binds weights itself).
    shared = nn.Sequential(*(copy.deepcopy(layer, {id(p): p for p in layer.parameters()}) for layer in split.layers))
    assert {id(p) for p in shared.parameters()} == {id(p) for p in split.layers.parameters()}
    assert_close(run_layers(shared, inputs), expected, "loss of parameter-sharing copies")


def test_copies_run_concurrently_in_threads():
    model = build_model("qwen3_moe")
    split = split_causal_lm(model)
    batches = [split.prepare_inputs(**make_batch("mixed", seed=seed)) for seed in range(4)]
    expected = [run_layers(split.layers, inputs).detach() for inputs in batches]
    copies = [nn.Sequential(*(copy.deepcopy(layer) for layer in split.layers)) for _ in batches]
    results = [None] * len(batches)

    def work(index):
        for _ in range(3):
            results[index] = run_layers(copies[index], batches[index]).detach()

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, want in zip(results, expected):
        assert_close(got, want, "loss computed in a thread")


def test_layer_outputs_follow_the_contract():
    model = build_model("gpt_oss")
    split = split_causal_lm(model)
    value = split.prepare_inputs(**make_batch("left"))
    for layer in split.layers[:-1]:
        value = layer(*value)
        assert isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value)
        assert all(t.shape[0] == 3 for t in value)
        assert all(t.dim() <= 3 for t in value)  # no B x T x T masks travel
        floats = [t for t in value[1:] if t.is_floating_point()]
        assert len(floats) == 1  # only the router probabilities ([Note: router statistics]) besides hidden
    loss = split.layers[-1](*value)
    assert loss.dim() == 0


def test_parameter_names_map_to_the_model():
    model = build_model("llama", tie_word_embeddings=True)
    names = split_causal_lm(model).parameter_names()
    assert names["0.inner.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert names["1.decoder_layer.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert names["3.lm.model.norm.weight"] == "model.norm.weight"
    assert len(names) == len(dict(model.named_parameters()))
