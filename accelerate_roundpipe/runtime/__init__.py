"""Executes a plan: host store, device workers, per-layer events, the optimizer thread, the engine facade; `LAYERS`,
the sub-packages' order."""

from .common.sync import EngineClosedError
from .engine.engine import RoundPipe
from .optimizer.optimizer import LaggedOptimizer, RoundPipeOptimizer

# The sub-packages bottom-up: each imports only from itself and the ones before it (tests/test_runtime_structure.py
# checks this and that no runtime files import each other in a circle; docs/architecture.md draws it).
LAYERS = ("common", "devices", "disk", "state", "execution", "stepping", "distribution", "optimizer", "engine")

__all__ = ["RoundPipe", "RoundPipeOptimizer", "LaggedOptimizer", "EngineClosedError"]
