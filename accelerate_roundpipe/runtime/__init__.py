"""Executes a plan: host store, device workers, per-layer events, the CPU optimizer, the engine facade."""

from .common.sync import EngineClosedError
from .engine.engine import RoundPipe
from .optimizer.optimizer import LaggedOptimizer, RoundPipeOptimizer

__all__ = ["RoundPipe", "RoundPipeOptimizer", "LaggedOptimizer", "EngineClosedError"]
