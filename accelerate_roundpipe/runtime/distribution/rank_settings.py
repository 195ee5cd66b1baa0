"""Whether this process trains data-parallel (`data_parallel`, env ROUNDPIPE_DATA_PARALLEL), and what differs
between the ranks' settings, one line per setting with every rank's value ([Note: data parallel], Construction)."""

from __future__ import annotations

from typing import Any


def process_group_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def wants_data_parallel(setting: bool | None) -> bool:
    """Whether an engine built now runs data-parallel (`data_parallel`, env ROUNDPIPE_DATA_PARALLEL)."""
    import torch.distributed as dist

    ready = process_group_ready()
    world = dist.get_world_size() if ready else 1
    if setting is None:
        return world > 1
    if setting is False:
        if world > 1:
            raise ValueError(f"data_parallel=False (env ROUNDPIPE_DATA_PARALLEL) but this run has {world} processes "
                             f"in its torch.distributed process group. Set data_parallel=True (or leave it unset) to "
                             f"train data-parallel, or launch one process.")
        return False
    if not ready:
        raise ValueError("data_parallel=True (env ROUNDPIPE_DATA_PARALLEL) needs an initialized torch.distributed "
                         "process group: call torch.distributed.init_process_group(...) (e.g. under torchrun) before "
                         "building the engine, or leave data_parallel unset.")
    return True


def _summary(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(value) if hasattr(value, '__len__') else '?'} items)"


def differences(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per setting whose value differs between ranks, with every rank's value."""
    lines = []
    for key in per_rank[0]:
        values = [settings.get(key) for settings in per_rank]
        if any(v != values[0] for v in values[1:]):
            if isinstance(values[0], list):
                first = next((i for i in range(max(len(v) for v in values))
                              if len({repr(v[i]) if i < len(v) else None for v in values}) > 1), None)
                shown = [f"rank {r}: {len(v)} entries, entry {first} = "
                         f"{_summary(v[first]) if first is not None and first < len(v) else 'missing'}"
                         for r, v in enumerate(values)]
            else:
                shown = [f"rank {r}: {_summary(v)}" for r, v in enumerate(values)]
            lines.append(f"{key}: " + "; ".join(shown))
    return lines
