"""A CPU worker's device: a worker thread with its own copies, streams and events that are no-ops.

Uploads and downloads clone, exactly as a GPU would copy, so the scheduler, the event protocol and the optimizer are
exercised unchanged without a GPU; the ordering logic is `Device`'s own ([Note: devices as classes]), run here with
work that is done when it is issued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .cpu_rng import StreamRandom
from .device import Device


class HostEvent:
    """A CPU worker's event: the work before it is done when the event is recorded."""

    __slots__ = ()

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStream:
    """A CPU worker's stream: work runs when it is issued, so there is nothing to wait for."""

    __slots__ = ()

    def record_event(self) -> HostEvent:
        return HostEvent()

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class CpuDevice(Device):
    def __init__(self, device: torch.device, index: int) -> None:
        super().__init__(device, index)
        self.compute_stream, self.act_in, self.act_out, self.param_in, self.grad_out = (
            self._new_stream(name) for name in ("compute", "activation upload", "activation download",
                                                "parameter upload", "gradient download"))

    def _new_stream(self, name: str):
        return HostStream()

    def start_thread(self) -> None:
        pass

    def _on_stream(self, stream):
        return contextlib.nullcontext()

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _page_locked_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)  # nothing to lock: no copy engine reads it

    def _hold(self, tensor: torch.Tensor, stream) -> None:
        pass  # memory is reused only once Python frees it

    @contextlib.contextmanager
    def rng(self, seed: int) -> Iterator[None]:
        with StreamRandom(seed):  # never the process-wide generator ([Note: CPU worker RNG])
            yield
