"""An `nn.Module` whose weights live in host memory and are moved by the engine itself: it refuses `.to()`,
`.cuda()`, `.half()`, ... which would move or cast them behind the host store's back."""

from __future__ import annotations

import torch
from torch import nn

from ...compat.torch_internals import parse_to_arguments


class HostResidentModule(nn.Module):
    def to(self, *args, **kwargs):
        device, dtype, _, _ = parse_to_arguments(*args, **kwargs)
        if dtype is None and (device is None or torch.device(device).type == "cpu"):
            return self
        raise RuntimeError("RoundPipe keeps the weights in host memory and moves them itself: do not call .to()/"
                           ".cuda() on it. Choose devices with RoundPipeConfig(devices=[...]) (env ROUNDPIPE_DEVICES) "
                           "and dtypes with param_dtype / optimizer_dtype.")

    def _apply(self, fn, recurse: bool = True):
        raise RuntimeError("RoundPipe keeps the weights in host memory and moves them itself: .cuda()/.half()/"
                           ".float() are not supported; use RoundPipeConfig(devices=..., param_dtype=...).")
