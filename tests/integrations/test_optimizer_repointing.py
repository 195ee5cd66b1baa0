"""[Note: optimizer re-pointing]: the user's optimizer object, moved onto the engine's optimizer copies."""

from __future__ import annotations

import warnings

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, named_groups, tiny_llama

from accelerate_roundpipe import LaggedOptimizer, RoundPipeAccelerator, RoundPipeConfig, RoundPipePlugin, wrap_model
from accelerate_roundpipe.integrations.optimizer import RoundPipeAcceleratedOptimizer, repoint_optimizer


def test_class_groups_and_hyper_parameters_are_kept():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(named_groups(model), lr=1e-3, betas=(0.8, 0.9), eps=1e-7)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    names_before = [[n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
                    for g in optimizer.param_groups]
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    lagged = repoint_optimizer(optimizer, [engine])
    assert isinstance(lagged, LaggedOptimizer) and lagged.inner is optimizer
    copies = dict(engine.named_parameters())
    for group, before, names in zip(optimizer.param_groups, groups_before, names_before):
        assert {k: v for k, v in group.items() if k not in ("params", "fused", "foreach")} == \
               {k: v for k, v in before.items() if k not in ("fused", "foreach")}
        assert [id(p) for p in group["params"]] == [id(copies[n]) for n in names]
    assert optimizer.param_groups[0]["fused"] is True  # AdamW on the CPU gets torch's fused kernel
    engine.close()


def test_frozen_parameters_drop_out_and_state_follows():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(named_groups(model), lr=0.1, momentum=0.9)
    embed = model.model.embed_tokens.weight
    optimizer.state[embed]["momentum_buffer"] = torch.ones_like(embed)  # e.g. loaded before prepare
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    repoint_optimizer(optimizer, [engine])
    copies = dict(engine.named_parameters())
    kept = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.requires_grad for p in kept) and len(kept) == sum(p.requires_grad for p in model.parameters())
    assert torch.equal(optimizer.state[copies["model.embed_tokens.weight"]]["momentum_buffer"],
                       torch.ones_like(embed))
    engine.close()


def test_foreign_or_shared_optimizers_are_refused():
    model, other = tiny_llama(), tiny_llama(seed=1)
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    with pytest.raises(ValueError, match="not parameters of the RoundPipe model"):
        repoint_optimizer(torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1),
                          [engine])
    with pytest.raises(ValueError, match="holds no parameter of a RoundPipe model"):
        repoint_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), [engine])
    second = wrap_model(other, RoundPipeConfig(**CPU_WORKERS))
    with pytest.raises(ValueError, match="spans the parameters of several"):
        repoint_optimizer(torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1), [engine, second])
    engine.close()
    second.close()


def test_scheduler_built_before_prepare_drives_the_lagged_step():
    """HF's no_trainer scripts build the LR scheduler on the bare optimizer before `prepare`."""
    model = tiny_llama()
    reference = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**CPU_WORKERS))
    model, prepared, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert isinstance(prepared, RoundPipeAcceleratedOptimizer) and prepared.optimizer.inner is optimizer
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda step: 0.5 ** step)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" from the lag
        for seed in range(3):
            batch = lm_batch(seed=seed)
            accelerator.backward(model(**batch).loss)
            prepared.step()
            scheduler.step()
            prepared.zero_grad()
            reference(**batch).loss.backward()
            reference_optimizer.step()
            reference_scheduler.step()
            reference_optimizer.zero_grad()
    assert prepared.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    state = accelerator.unwrap_model(model).state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0, msg=name)
    accelerator.roundpipe_engine(model).close()
