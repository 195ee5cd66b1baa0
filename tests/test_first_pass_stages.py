"""[Note: first-pass backward stages]: at a batch whose saved inputs would not fit the host's share, the first
(unplanned) pass runs backward stages of several layers, fewer saved inputs, and the same numbers as plain PyTorch
(float64, CPU workers); the measured plan replaces it after that pass. The engine's own partition only, and only when
the inputs do not fit."""

from __future__ import annotations

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig
from accelerate_roundpipe.integrations.convert import wrap_model
from accelerate_roundpipe.plan.first_pass_sizing import regrouped_partition, saved_stage_inputs
from accelerate_roundpipe.plan.partition import plan_partition
from accelerate_roundpipe.runtime.execution import first_pass

transformers = pytest.importorskip("transformers")

DECODER_LAYERS = 6  # the pipeline: the embedding, 6 decoder layers, the head: 8 layers


def test_the_saved_input_count_is_the_partitions():
    for num_layers in range(3, 14):
        assert regrouped_partition(num_layers, 1) == plan_partition(num_layers)  # k = 1: the unplanned partition
        for k in range(1, num_layers + 1):
            partition = regrouped_partition(num_layers, k)
            assert all(len(span) == k for span in partition.backward[1:])  # from the top; the bottom one the rest
            saved = partition.saved_input_layers("stage", fused=True) - {0}  # layer 0's input: the token ids
            assert len(saved) == saved_stage_inputs(num_layers, k), (num_layers, k)


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=DECODER_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).double()


def _batch():
    return torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))


def _reference(model, ids):
    """Plain PyTorch: the mean next-token cross-entropy in float64, and every gradient."""
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _engine_pass(engine, ids):
    loss = engine.forward_backward(input_ids=ids, labels=ids)
    engine.synchronize()
    grads = {name: p.grad.clone() for name, p in engine.named_parameters()}
    engine.zero_grad()
    return loss.detach(), grads


def _check(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("plan", ["measured", "static"])
def test_a_host_without_room_for_the_saved_inputs_runs_fewer_backward_stages(monkeypatch, plan):
    monkeypatch.setattr(first_pass, "SAVED_HOST_SHARE", 0.0)  # no room for any saved input
    model = _model()
    ids = _batch()
    reference = _reference(model, ids)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], summary=False, plan=plan))
    try:
        unplanned = engine._launch.unplanned
        assert len(unplanned.saved_input_layers("stage") - {0}) == DECODER_LAYERS  # every decoder layer's input
        first = _engine_pass(engine, ids)
        sizing = engine._microbatches.sizing
        # 8 layers in stages of 4: the fused stage and the bottom one, which saves the caller's token ids only
        assert sizing.stage_layers == 4 and "backward stages of 4 layers" in sizing.reason()
        assert sizing.stages_reason(8).startswith(  # the start summary's words: 6 decoder inputs of 8 x 32 x 16 x 8 B
            "backward stages of 4 layers on the first pass: one-layer stages would keep 6 layer inputs of 32.000 KiB")
        assert engine.partition == sizing.partition == regrouped_partition(8, 4)
        assert engine.partition.saved_input_layers("stage") - {0} == frozenset()
        _check(first, reference)
        second = _engine_pass(engine, ids)
        if plan == "measured":  # the measured plan's partition from here on
            assert engine._launch.plan.layer_costs is not None and engine.partition != sizing.partition
        else:  # every pass of a static plan is unplanned: the same shape, the same stages
            assert engine.partition == sizing.partition
        _check(second, reference)
    finally:
        engine.close()


def test_a_host_with_room_keeps_the_one_layer_stages_and_a_users_stages_are_kept(monkeypatch):
    model = _model()
    ids = _batch()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        engine.forward_backward(input_ids=ids, labels=ids)
        assert engine._microbatches.sizing.stage_layers == 1 and engine._microbatches.sizing.partition is None
        assert engine._microbatches.sizing.stages_reason(8) is None
        engine.synchronize()
    finally:
        engine.close()
    given = RoundPipeConfig(devices=["cpu", "cpu"], summary=False, plan="static", backward_stages=[1] * 8)
    engine = wrap_model(_model(), given)
    try:
        monkeypatch.setattr(first_pass, "SAVED_HOST_SHARE", 0.0)  # no room: still the stages the user set
        engine.forward_backward(input_ids=ids, labels=ids)
        assert engine.partition == engine._launch.unplanned and len(engine.partition.backward) == 8
        engine.synchronize()
    finally:
        engine.close()


def test_one_row_of_the_stage_must_fit_the_device(monkeypatch):
    """Stages grow only while one row of their layers fits what the device leaves a micro-batch: the sizer keeps
    the largest that fits and the saved-input warning says the rest."""
    monkeypatch.setattr(first_pass, "SAVED_HOST_SHARE", 0.0)
    engine = wrap_model(_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        sizer = engine._microbatches.sizer
        per_row = first_pass.row_activations(engine.module.config, 32, sizer.element_size)
        two_layers = regrouped_partition(8, 2)
        room = per_row.total_bytes * 2 + sizer._stage_bytes(two_layers)  # one row of 2 layers, not of 3
        monkeypatch.setattr(sizer, "host_bytes", lambda: room / first_pass.PLAN_SHARE)
        sizing = sizer.size(8, 32, 4)
        assert sizing.stage_layers == 2 and sizing.partition == two_layers
    finally:
        engine.close()


def test_the_accelerate_path_runs_the_regrouped_stages_exactly(monkeypatch):
    """The Trainer's and Accelerate's way: `model(...)` kept for a backward, then `accelerator.backward(loss)`; the
    forward pass is sized, and regrouped, as `forward_backward` is."""
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state
    from accelerate_roundpipe.integrations.accelerator import RoundPipeAccelerator
    from accelerate_roundpipe.integrations.plugin import RoundPipePlugin

    monkeypatch.setattr(first_pass, "SAVED_HOST_SHARE", 0.0)
    model = _model()
    ids = _batch()
    ref_loss, ref_grads = _reference(model, ids)
    reset_accelerate_state()
    accelerator = RoundPipeAccelerator(
        roundpipe_plugin=RoundPipePlugin(devices=["cpu", "cpu"], plan="measured", summary=False))
    prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    engine = accelerator.roundpipe_engine(prepared)
    try:
        logits = prepared(input_ids=ids).logits
        assert engine._microbatches.sizing.stage_layers == 4 and engine.partition == regrouped_partition(8, 4)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        accelerator.backward(loss)
        engine.synchronize()
        _check((loss.detach(), {name: p.grad.clone() for name, p in engine.named_parameters()}), (ref_loss, ref_grads))
    finally:
        engine.close()
        reset_accelerate_state()



def test_the_first_pass_leaves_room_for_what_the_store_still_allocates(monkeypatch):
    """A host whose available memory holds the saved inputs by a quarter of it, but not beside the gradient buffers
    and optimizer states the store allocates later (the first step's): the first pass regroups, exactly. Before,
    only the quarter was asked and every layer's input was kept."""
    model = _model()
    ids = _batch()
    reference = _reference(model, ids)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        sizer = engine._microbatches.sizer
        saved = DECODER_LAYERS * ids.numel() * model.config.hidden_size * sizer.element_size
        available = 2.0**26
        assert available * first_pass.SAVED_HOST_SHARE >= saved  # the quarter alone would keep them all
        monkeypatch.setattr(first_pass, "available_memory_bytes", lambda: available)
        monkeypatch.setattr(sizer, "pending_host_bytes", lambda: available - saved / 2)
        first = _engine_pass(engine, ids)
        assert engine._microbatches.sizing.stage_layers > 1
        assert len(engine.partition.saved_input_layers("stage") - {0}) < DECODER_LAYERS
        _check(first, reference)
    finally:
        engine.close()


def test_what_the_store_still_allocates_on_the_host(tmp_path):
    """The gradient buffers not made yet and the optimizer states (assumed not made yet): AdamW's two before an
    optimizer is wrapped, the wrapped optimizer's count after (the placement's), disk buckets' gradients too."""
    model = _model()
    ids = _batch()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        sizer = engine._microbatches.sizer
        flat = sum(b.optim.numel() * b.optim.element_size() for b in engine.host_store.trainable_buckets)
        assert sizer.pending_host_bytes() == 3 * flat  # gradients and AdamW's two states, nothing wrapped yet
        engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.0))  # no momentum: no state
        assert sizer.pending_host_bytes() == flat  # the gradients only
        engine.forward_backward(input_ids=ids, labels=ids)
        engine.synchronize()
        assert sizer.pending_host_bytes() == 0  # every bucket holds its gradient now
    finally:
        engine.close()
    engine = wrap_model(_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3, amsgrad=True))
        assert engine._microbatches.sizer.pending_host_bytes() == 4 * flat  # gradients and three states
    finally:
        engine.close()
    engine = wrap_model(_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False, host_memory_budget=1e-9,
                                                  offload_dir=str(tmp_path)))
    try:
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
        on_disk = [b for b in engine.host_store.trainable_buckets if not b.tier.optim_resident]
        assert on_disk  # every bucket the budget could move; their states are in swap files, their gradients not
        disk_flat = sum(b.optim.numel() * b.optim.element_size() for b in on_disk)
        assert engine._microbatches.sizer.pending_host_bytes() == 3 * (flat - disk_flat) + disk_flat
    finally:
        engine.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["torch-cache", "pooled-blocks"])
def test_on_gpus_the_saved_inputs_are_counted_as_their_page_locked_blocks_hold_them(monkeypatch, pooled):
    """A saved input downloaded from a GPU is counted as the block that holds it, so the first pass's host room is
    weighed against that (here modelled on CPU workers by counting their inputs as a GPU's would be):
    - the store's pool off (the default): a power-of-two block of torch's page-locked cache
      ([Note: saved inputs in the start summary]);
    - the pool on: the same 10 KiB inputs take 10 KiB blocks ([Note: saved inputs in pooled blocks])."""
    from accelerate_roundpipe.runtime.state import saved_input_buffers

    monkeypatch.setattr(saved_input_buffers, "POOLED", pooled)
    monkeypatch.setattr(first_pass, "SAVED_HOST_SHARE", 0.0)
    engine = wrap_model(_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False, plan="static"))
    try:
        engine._microbatches.sizer.saved_on_host = False  # as on GPUs
        ids = torch.randint(0, 64, (8, 40), generator=torch.Generator().manual_seed(1))
        engine.forward_backward(input_ids=ids, labels=ids)
        sizing = engine._microbatches.sizing
        if pooled:
            assert sizing.input_bytes == 8 * 40 * 16 * 8 == 40 * 1024
        else:
            # 4 micro-batches of 2 rows x 40 tokens x 16 hidden x 8 bytes = 10 KiB each, a 16 KiB block: 1.6 times
            assert sizing.input_bytes == 8 * 40 * 16 * 8 * 16384 // 10240 == 64 * 1024
            assert "6 layer inputs of 64.000 KiB as allocated, more than the" in sizing.stages_reason(8)
        engine.synchronize()
    finally:
        engine.close()
