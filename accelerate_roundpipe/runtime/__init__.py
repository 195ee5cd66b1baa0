"""Executes a plan: host store, device workers, per-layer events, the lagged CPU optimizer, the engine facade."""

from .engine import RoundPipe
from .optimizer import LaggedOptimizer
from .sync import EngineClosedError

__all__ = ["RoundPipe", "LaggedOptimizer", "EngineClosedError"]
