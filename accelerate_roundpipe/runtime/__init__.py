"""Executes a plan: host store, device workers, per-layer events, the CPU optimizer, the engine facade."""

from .engine import RoundPipe
from .optimizer import LaggedOptimizer, RoundPipeOptimizer
from .sync import EngineClosedError

__all__ = ["RoundPipe", "RoundPipeOptimizer", "LaggedOptimizer", "EngineClosedError"]
