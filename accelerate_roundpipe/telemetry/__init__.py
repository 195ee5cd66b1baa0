"""What the pipeline did: timeline traces, live metrics, the start summary."""

from .trace import TraceRecorder, maybe_span

__all__ = ["TraceRecorder", "maybe_span"]
