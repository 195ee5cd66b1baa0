"""The host-memory warning: the store's size per parameter kind, and a warning only when it will not fit."""

from __future__ import annotations

import logging

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.state import host_budget

GiB = 2**30


def test_store_bytes_per_parameter_kind():
    fp32 = lambda dtype: torch.float32  # noqa: E731
    # bf16 trainable: 2 (compute) + 4 x (optimizer copy, gradient, 2 AdamW states) = 18 bytes per parameter; no
    # spare gradient buffer ([Note: no spare gradient buffer])
    assert host_budget.store_bytes([(1000, torch.bfloat16, True)], fp32) == 18_000
    assert host_budget.store_bytes([(1000, torch.bfloat16, False)], fp32) == 2_000  # frozen: the compute copy only


def test_warns_only_when_the_store_will_not_fit(caplog):
    with caplog.at_level(logging.WARNING, logger=host_budget.__name__):
        assert host_budget.warn_if_short(10 * GiB, freed=0, available=100 * GiB) is None
        assert host_budget.warn_if_short(95 * GiB, freed=10 * GiB, available=100 * GiB) is None  # freed counts
        message = host_budget.warn_if_short(95 * GiB, freed=0, available=100 * GiB)
    assert message is not None and "95.0 GiB" in message and "100.0 GiB available" in message and "LoRA" in message
    assert caplog.records and caplog.records[-1].getMessage() == message


def test_engine_warns_before_building_a_store_too_big(monkeypatch, caplog):
    monkeypatch.setattr(host_budget, "available_bytes", lambda: 1000)  # 1 KB of host memory left
    with caplog.at_level(logging.WARNING, logger=host_budget.__name__):
        engine = RoundPipe(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), RoundPipeConfig(devices=["cpu"]))
    engine.close()
    assert any("host store needs about" in r.getMessage() for r in caplog.records)
