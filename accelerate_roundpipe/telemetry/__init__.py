"""What the pipeline did: timeline traces (more metrics arrive with the telemetry issue)."""

from .trace import TraceRecorder, maybe_span

__all__ = ["TraceRecorder", "maybe_span"]
