"""A `PendingGradNorm` (what `clip_grad_norm_` returns under RoundPipe) behaves as the plain 0-dim tensor torch's
clip returns in everything users do with it; each use is checked on a fresh, still unread norm, so each one must
fill it in ([Note: clipping without a drain])."""

from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch

from accelerate_roundpipe.runtime.common.sync import FailureFlag
from accelerate_roundpipe.runtime.stepping.step_norm import PendingGradNorm, StepNorm

SQUARES = 2.0  # the norm is sqrt(2): not a round number, so rounding differences would show


def _pending(dtype: torch.dtype = torch.float32) -> PendingGradNorm:
    step_norm = StepNorm(1, max_norm=1.0, dtype=dtype)
    step_norm.add(SQUARES)
    return PendingGradNorm(step_norm, FailureFlag(), dtype)


def _plain(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(SQUARES ** 0.5, dtype=dtype)


def _log_line(value) -> str:
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test_pending_grad_norm")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("grad_norm %s %.4f", value, value)
    finally:
        logger.removeHandler(handler)
    return records[0]


USES = {
    "format .3f": lambda n: f"{n:.3f}",
    "format empty": lambda n: f"{n}",
    "format e": lambda n: format(n, ".2e"),
    "str": str,
    "repr": repr,
    "percent format": lambda n: "%.5f" % n,  # noqa: UP031 (a use users have)
    "float": float,
    "int": int,
    "item": lambda n: n.item(),
    "tolist": lambda n: n.tolist(),
    "round": lambda n: round(float(n), 4),
    "bool of a comparison": lambda n: bool(n > 1.0),
    "less than": lambda n: (n < 2.0).item(),
    "equal": lambda n: (n == _plain(n.dtype)).item(),
    "python comparison": lambda n: 1.0 < n,
    "add": lambda n: (n + 1.0).item(),
    "radd": lambda n: (1.0 + n).item(),
    "multiply": lambda n: (n * 3).item(),
    "divide": lambda n: (n / 2).item(),
    "rdivide": lambda n: (2 / n).item(),
    "power": lambda n: (n ** 2).item(),
    "torch.isfinite": lambda n: torch.isfinite(n).item(),
    "math.isfinite": math.isfinite,
    "math.isnan": math.isnan,
    "torch.stack": lambda n: torch.stack([n, n]).tolist(),
    "dtype": lambda n: n.dtype,
    "shape": lambda n: tuple(n.shape),
    "detach item": lambda n: n.detach().item(),
    "cpu item": lambda n: n.cpu().item(),
    "logging": _log_line,
    "pickle": lambda n: pickle.loads(pickle.dumps(n)).item(),
    "pickle of a log history": lambda n: pickle.loads(pickle.dumps([{"grad_norm": n}]))[0]["grad_norm"].item(),
    "deepcopy": lambda n: copy.deepcopy(n).item(),
    "numpy": lambda n: float(n.numpy()),
}


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_pending_norm_behaves_as_the_plain_tensor(use, dtype):
    pending, plain = _pending(dtype), _plain(dtype)
    expected, got = USES[use](plain), USES[use](pending)
    assert got == expected, (use, got, expected)
    assert type(got) is type(expected)
    assert repr(pending) == repr(plain)  # resolved once, and a plain tensor's text ever after
