"""Memory for the benchmarks: GPU and host peaks over a run, an emulated smaller card, out-of-memory errors."""

from __future__ import annotations

import torch


def host_peak_gib() -> float | None:
    """This process's peak resident memory (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


class PeakMeter:
    """GPU peak (max allocated over the given CUDA devices) and host peak RSS, from construction on."""

    def __init__(self, cuda_indices: list[int]) -> None:
        self.cuda = cuda_indices
        for i in self.cuda:
            torch.cuda.reset_peak_memory_stats(i)
        try:  # Linux: "5" resets the peak RSS to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def read(self) -> dict:
        gpu = max((torch.cuda.max_memory_allocated(i) / 2**30 for i in self.cuda), default=None)
        return {"gpu_peak_gib": None if gpu is None else round(gpu, 2), "host_peak_gib": host_peak_gib()}


def _cuda_index(device) -> int:
    """The index of `device` as `torch.cuda.mem_get_info` takes it (None: the current device)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def memory_cap(cap_gib: float) -> None:
    """Emulate a smaller card as the anchors do, on every visible GPU (a run on several GPUs emulates several such
    cards): the caching allocator capped, and `mem_get_info` reporting the cap (the reference RoundPipe sizes itself
    from it)."""
    if not cap_gib or not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), index)
    original = torch.cuda.mem_get_info

    def capped(device=None):
        free, _ = original(device)
        cap = int(cap_gib * 2**30)
        return max(0, min(free, cap - torch.cuda.memory_reserved(_cuda_index(device)))), cap

    torch.cuda.mem_get_info = capped


def is_oom(error: BaseException) -> bool:
    """Whether the error, or one it was raised from, is the GPU running out of memory (engine errors wrap it)."""
    seen = error
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, torch.cuda.OutOfMemoryError) or "out of memory" in text or "cuda_error_out_of_memory" in \
                text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
