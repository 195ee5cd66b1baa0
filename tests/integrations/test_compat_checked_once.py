"""The compat checks made on every training step read the library's code once per function, not per step
([Note: compat checks run once]); a check that fails still raises, on its first call and on every later one.

Each case is one per-step reach, called as its caller calls it: the function it reads is replaced by a copy of
itself (the same code, a function not read yet), and `compat._code`, where every reading of a library's code
starts, is counted."""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch

from accelerate_roundpipe import compat
from accelerate_roundpipe.compat import LibraryChangedError, hf_trainer, torch_internals, trl_internals
from accelerate_roundpipe.compat import accelerate_internals as acc


def gradient_accumulation_scale():
    """`RoundPipeTrainer.training_step`, every step."""
    from transformers import Trainer

    trainer = SimpleNamespace(loss_is_scaled_for_ga=None, model_accepts_loss_kwargs=False, compute_loss_func=None,
                              current_gradient_accumulation_steps=4)
    return (Trainer, "training_step", lambda: hf_trainer.training_step_grad_scale(trainer, None,
                                                                                   Trainer.training_step),
            "gradient-accumulation scale")


def num_processes_factor():
    """`RoundPipeTrainer.compute_loss` with several processes, every step."""
    return (hf_trainer.original_trainer(), "compute_loss",
            lambda: hf_trainer.compute_loss_process_factor(True, True, 10, 4), "num_processes factor")


def nested_gather_swap():
    """`RoundPipeTrainer._maybe_log_save_evaluate` with several processes, every step."""
    from transformers import Trainer

    def swapped():
        with hf_trainer.trainer_module_name_swapped("nested_gather", "ours", Trainer._maybe_log_save_evaluate):
            pass

    return Trainer, "_maybe_log_save_evaluate", swapped, "nested_gather"


def scheduler_flag():
    """The RoundPipe optimizer's `step`, every optimizer step."""
    from torch.optim.lr_scheduler import LRScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return LRScheduler, "step", lambda: torch_internals.mark_stepped_for_scheduler(optimizer), "_opt_called"


def collective_backend():
    """`RoundPipeAccelerator`'s gather / reduce / pad_across_processes (the Trainer's logged loss, every log)."""
    from accelerate.state import PartialState

    state = SimpleNamespace(backend="gloo")
    return PartialState, "__init__", lambda: acc.state_backend(state), "PartialState.backend"


def fused_head_temperature():
    """The RoundPipe model's fused-LM-head forward under TRL, every step."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl; it is in the test extras)")
    import trl.trainer.utils as utils

    return utils, "add_fused_lm_head", trl_internals.fused_forward_code, "add_fused_lm_head"


CASES = [gradient_accumulation_scale, num_processes_factor, nested_gather_swap, scheduler_flag, collective_backend,
         fused_head_temperature]


def copy_of(function):
    """`function` again, as a new function object: one no check has read yet."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    copy.__dict__.update(function.__dict__)
    return copy


def changed(*args, **kwargs):  # a library function that no longer reads, or defines, anything the checks look for
    return None


def count_readings(monkeypatch) -> list[int]:
    """Counts the readings of a function's code: `compat._code`, and `_code_objects`, through which `mentions`
    reads (counted too, so the count also shows a `mentions` that reads without `_code`)."""
    count = [0]

    def counting(read):
        def counted(function):
            count[0] += 1
            return read(function)

        return counted

    for name in ("_code", "_code_objects"):
        monkeypatch.setattr(compat, name, counting(getattr(compat, name)))
    return count


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_a_per_step_check_reads_the_library_once(case, monkeypatch):
    owner, attribute, step, _ = case()
    monkeypatch.setattr(owner, attribute, copy_of(getattr(owner, attribute)))
    readings = count_readings(monkeypatch)
    step()
    first = readings[0]
    assert first > 0  # the first call did read the (new) function
    for _ in range(3):
        step()
    assert readings[0] == first


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_a_per_step_check_that_fails_raises_on_every_call(case, monkeypatch):
    owner, attribute, step, reach = case()
    step()  # the real function passes (and is remembered)
    monkeypatch.setattr(owner, attribute, changed)
    for _ in range(2):
        with pytest.raises(LibraryChangedError, match=reach):
            step()
