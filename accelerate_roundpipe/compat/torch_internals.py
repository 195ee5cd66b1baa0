"""The reaches into torch's private API ([Note: compatibility reaches]). Written against torch 2.13 (and 2.11, on
the GPU machine). Callers: `integrations/multi_process.py` (the default group's timeout and store, the engine's
autograd nodes), `runtime/optimizer/optimizer.py` (the scheduler's step flag), `integrations/grad_norm.py` (the
vectorised norms), `runtime/state/host_resident.py` (what `.to()` asks for), `runtime/execution/weight_buffers.py`
(a storage's reference count)."""

from __future__ import annotations

import datetime
import importlib

import torch

from . import LibraryChangedError, require_attribute, require_mention, require_parameters

LIBRARY = "torch"


def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """Make the default process group's collectives time out after `timeout` ([Note: collective timeouts]):
    `torch.distributed.distributed_c10d._set_pg_timeout(timeout, group=None)`, private, the only way to change a
    live group's timeout (torch 2.11 and 2.13)."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    reach = "torch.distributed.distributed_c10d._set_pg_timeout"
    set_timeout = require_attribute(c10d, "_set_pg_timeout", LIBRARY, reach)
    require_parameters(set_timeout, ("timeout", "group"), LIBRARY, reach)
    set_timeout(timeout)


def default_group_store():
    """The key-value store the default process group was made with (a `torch.distributed.Store`: TCPStore under
    torchrun and accelerate, FileStore, ...): `torch.distributed.distributed_c10d._get_default_store()`, private
    (torch 2.11 and 2.13), the only way to the group's own store. The ranks' agreements write what each rank is
    doing there ([Note: tagged agreements] in `integrations/multi_process.py`)."""
    import torch.distributed as dist

    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    reach = "torch.distributed.distributed_c10d._get_default_store"
    get_store = require_attribute(c10d, "_get_default_store", LIBRARY, reach)
    store = get_store()
    if not isinstance(store, dist.Store):
        raise LibraryChangedError(LIBRARY, reach, f"it returned a {type(store).__name__}, not a "
                                                  f"torch.distributed.Store")
    return store


def mark_stepped_for_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Say to an LR scheduler built on `optimizer` that its step was taken: the `_opt_called` flag its wrapper of
    `optimizer.step` sets and `LRScheduler.step` reads, to warn "lr_scheduler.step() before optimizer.step()" (torch
    2.13). RoundPipe's step runs later, on another thread ([Note: scheduler step count]). Checked on every optimizer
    step, reading `LRScheduler.step` once ([Note: compat checks run once])."""
    from torch.optim.lr_scheduler import LRScheduler

    require_mention(LRScheduler.step, "_opt_called", LIBRARY, "the `_opt_called` flag LRScheduler.step reads")
    optimizer._opt_called = True


def backward_node_class(function: type) -> type:
    """The class of the autograd node a `torch.autograd.Function` subclass's outputs carry as `grad_fn`: its
    private `_backward_cls` (torch 2.13), by which RoundPipe recognises its own nodes in a loss's graph. It must be
    the subclass's own: the one inherited from `torch.autograd.Function` would match no node of ours."""
    reach = "torch.autograd.Function._backward_cls"
    node = require_attribute(function, "_backward_cls", LIBRARY, reach)
    if "_backward_cls" not in vars(function):
        raise LibraryChangedError(LIBRARY, reach, f"{function.__qualname__} has none of its own (only an inherited "
                                                  f"one)")
    if not isinstance(node, type):
        raise LibraryChangedError(LIBRARY, "torch.autograd.Function._backward_cls", "it is no longer a class")
    return node


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each of `tensors`, in one vectorised call: torch's private `torch._foreach_norm` (torch 2.11
    and 2.13), which `LateGradNorm` uses to measure a bucket's gradients on the optimizer thread without one
    reduction per tensor ([Note: late grad norm])."""
    reach = "torch._foreach_norm"
    norms = require_attribute(torch, "_foreach_norm", LIBRARY, reach)
    if not callable(norms):
        raise LibraryChangedError(LIBRARY, reach, "it is no longer callable")
    return norms(tensors)


def parse_to_arguments(*args, **kwargs) -> tuple:
    """`nn.Module.to`'s arguments read as torch reads them, (device, dtype, non_blocking, memory_format): torch's
    private `torch._C._nn._parse_to` (torch 2.11 and 2.13), by which `HostResidentModule.to` tells a no-op `.to()`
    from a move it refuses."""
    reach = "torch._C._nn._parse_to"
    parse = require_attribute(torch._C._nn, "_parse_to", LIBRARY, reach)
    parsed = parse(*args, **kwargs)
    if not isinstance(parsed, tuple) or len(parsed) != 4:
        raise LibraryChangedError(LIBRARY, reach, "it no longer returns (device, dtype, non_blocking, memory_format)")
    return parsed


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references the memory under `tensor` has: `tensor` itself, the storage object this call makes,
    and one per other tensor (a view, a tensor an autograd graph saved) on it (`torch._C._storage_Use_Count`, private;
    a torch without it reports a count that keeps every buffer out of reuse)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return -1
    return use_count(tensor.untyped_storage()._cdata)
