"""Every reach into another library's internals ([Note: compatibility reaches]) holds on the installed versions, and
fails loudly, naming the library, its version and the reach, when the internal it relies on changes.

Written against torch 2.13 (2.11 on the GPU machine), transformers 5.24, accelerate 1.15, peft 0.21 and trl 1.16
(`compat.WRITTEN_AGAINST`). Each faked change removes or reshapes the internal for the test only (monkeypatch).
"""

from __future__ import annotations

import datetime
import os
import re
import warnings

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama
from process_group_helpers import default_group_timeout_around, default_group_up
from torch import nn

from accelerate_roundpipe.compat import (
    WRITTEN_AGAINST,
    LibraryChangedError,
    hf_models,
    hf_trainer,
    installed_version,
    launcher_swaps,
    mentions,
    torch_internals,
    trl_internals,
)
from accelerate_roundpipe.compat import accelerate_internals as acc


def changed(library: str, reach: str):
    """The loud error: names the library, its installed version, the reach and what to do."""
    version = re.escape(installed_version(library))
    return pytest.raises(LibraryChangedError, match=rf"(?s){library} {version}.*{reach}.*written against {library}"
                                                    rf".*pip install")


def test_the_error_names_the_versions_written_against_and_what_to_do():
    error = LibraryChangedError("transformers", "Trainer._wrap_model", "it is gone")
    text = str(error)
    assert f"transformers {installed_version('transformers')}" in text
    assert f"written against transformers {WRITTEN_AGAINST['transformers']}" in text
    assert "pip install 'transformers==5.24.*'" in text and "report" in text and "it is gone" in text


# ---------------------------------------------------------------------- transformers: the Trainer


def test_trainer_overrides_hold_on_the_installed_transformers():
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)


def test_a_private_trainer_method_gone_is_refused_when_the_trainer_is_built(monkeypatch):
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    monkeypatch.delattr(Trainer, "_wrap_model")
    with changed("transformers", r"Trainer\._wrap_model"):
        RoundPipeTrainer(model=None)


def test_a_private_trainer_method_with_a_parameter_dropped_is_refused(monkeypatch):
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    monkeypatch.setattr(Trainer, "_get_grad_norm", lambda self, grad_norm: None)  # `model` dropped
    with changed("transformers", r"Trainer\._get_grad_norm"):
        hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)


def test_a_private_trainer_method_with_a_parameter_added_is_refused(monkeypatch):
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    monkeypatch.setattr(Trainer, "_save_checkpoint", lambda self, model, trial, metrics: None)  # `metrics` required
    with changed("transformers", r"Trainer\._save_checkpoint"):
        hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)


def test_a_trainer_method_added_under_a_roundpipe_name_is_refused(monkeypatch):
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    monkeypatch.setattr(Trainer, "_is_auxiliary_model", lambda self, model: False, raising=False)
    with changed("transformers", r"_is_auxiliary_model"):
        hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)


def test_trainer_module_names_are_swapped_for_one_block_only():
    import transformers.trainer as trainer_module
    from transformers import Trainer

    original = trainer_module.Accelerator
    with hf_trainer.trainer_module_name_swapped("Accelerator", "ours", Trainer.create_accelerator_and_postprocess):
        assert trainer_module.Accelerator == "ours"
    assert trainer_module.Accelerator is original
    assert hf_trainer.trainer_module_original("nested_gather") is trainer_module.nested_gather
    with hf_trainer.trainer_module_name_swapped("nested_gather", "ours", Trainer._maybe_log_save_evaluate):
        assert trainer_module.nested_gather == "ours"


def test_a_trainer_module_name_no_longer_looked_up_is_refused(monkeypatch):
    import transformers.trainer as trainer_module
    from transformers import Trainer

    def create_accelerator_and_postprocess(self):  # builds its accelerator some other way
        return None

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", create_accelerator_and_postprocess)
    with changed("transformers", r"transformers\.trainer\.Accelerator"):
        with hf_trainer.trainer_module_name_swapped("Accelerator", "ours", Trainer.create_accelerator_and_postprocess):
            pass
    monkeypatch.delattr(trainer_module, "nested_gather")
    with changed("transformers", r"transformers\.trainer\.nested_gather"):
        hf_trainer.trainer_module_original("nested_gather")


def test_the_gradient_accumulation_scale_of_the_trainers_step():
    from types import SimpleNamespace

    from transformers import Trainer

    def trainer(**values):
        return SimpleNamespace(**{"loss_is_scaled_for_ga": None, "model_accepts_loss_kwargs": False,
                                  "compute_loss_func": None, "current_gradient_accumulation_steps": 4, **values})

    step = Trainer.training_step
    assert hf_trainer.training_step_grad_scale(trainer(), None, step) == 0.25
    assert hf_trainer.training_step_grad_scale(trainer(model_accepts_loss_kwargs=True), 10, step) == 1.0
    assert hf_trainer.training_step_grad_scale(trainer(model_accepts_loss_kwargs=True), None, step) == 0.25
    assert hf_trainer.training_step_grad_scale(trainer(compute_loss_func=len), None, step) == 1.0
    # Where the step reads `loss_is_scaled_for_ga` (transformers 5.24), it decides; older steps (5.17) never read it.
    newer = mentions(Trainer.training_step, "loss_is_scaled_for_ga")
    assert hf_trainer.training_step_grad_scale(trainer(loss_is_scaled_for_ga=False, compute_loss_func=len), 10,
                                               step) == (0.25 if newer else 1.0)

    def training_step(self, model, inputs, num_items_in_batch=None):  # scales some other way
        return self.compute_loss(model, inputs) / self.args.gradient_accumulation_steps

    with changed("transformers", r"gradient-accumulation scale"):
        hf_trainer.training_step_grad_scale(trainer(), None, training_step)


def test_gpus_per_process_is_limited_through_the_private_n_gpu(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    hf_trainer.limit_gpus_per_process(args, 0)
    assert args.n_gpu == 0


def test_an_n_gpu_not_read_from_n_gpu_private_is_refused(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 0))  # setting `_n_gpu` would change nothing
    with changed("transformers", r"TrainingArguments\._n_gpu"):
        hf_trainer.limit_gpus_per_process(args, 1)


def test_trainer_file_names_and_rotation(tmp_path, monkeypatch):
    import transformers.trainer as trainer_module
    import transformers.trainer_utils as trainer_utils

    assert hf_trainer.trainer_file_names() == ("trainer_state.json", "optimizer.pt", "scheduler.pt")
    for step in (1, 2, 3):
        os.makedirs(tmp_path / f"checkpoint-{step}")
    hf_trainer.rotate_checkpoints(str(tmp_path), 2, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]

    monkeypatch.setattr(trainer_utils, "rotate_checkpoints", lambda output_dir, save_total_limit=None: None)
    with changed("transformers", r"rotate_checkpoints"):
        hf_trainer.rotate_checkpoints(str(tmp_path), 1, None)
    monkeypatch.delattr(trainer_module, "SCHEDULER_NAME")
    with changed("transformers", r"SCHEDULER_NAME"):
        hf_trainer.trainer_file_names()


# ---------------------------------------------------------------------- accelerate: the Accelerator


def test_accelerator_overrides_hold_on_the_installed_accelerate():
    from accelerate_roundpipe.integrations.accelerator import RoundPipeAccelerator

    acc.check_accelerator_overrides(RoundPipeAccelerator, acc.original_accelerator())


def test_an_accelerator_method_with_other_parameters_is_refused_when_built(monkeypatch):
    import accelerate

    from accelerate_roundpipe.integrations.accelerator import RoundPipeAccelerator

    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", lambda self, model, evaluation_mode=False: model)
    with changed("accelerate", r"Accelerator\.prepare_model"):
        RoundPipeAccelerator(cpu=True)


def test_the_original_accelerator_is_found_under_the_launcher():
    import accelerate.accelerator

    from accelerate_roundpipe.launch.install import installed

    own = accelerate.accelerator.Accelerator
    with installed():
        assert acc.original_accelerator() is own


def test_accelerator_private_lists_and_markers(monkeypatch):
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    assert acc.prepared_models(accelerator) is accelerator._models
    assert acc.prepared_optimizers(accelerator) is accelerator._optimizers
    model = nn.Linear(2, 2)
    assert not acc.is_prepared(model)
    acc.mark_prepared(model)
    assert acc.is_prepared(model) and accelerator.prepare(model) is model  # accelerate passes it through
    acc.turn_off_autocast(accelerator)
    assert accelerator.native_amp is False

    monkeypatch.setattr(accelerate.Accelerator, "save_state", lambda self, output_dir=None: None)
    with changed("accelerate", r"Accelerator\._models"):
        acc.prepared_models(accelerator)
    monkeypatch.setattr(accelerate.Accelerator, "prepare", lambda self, *args: args)
    with changed("accelerate", r"_is_accelerate_prepared"):
        acc.mark_prepared(model)
    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", lambda self, model: model)
    with changed("accelerate", r"native_amp"):
        acc.turn_off_autocast(accelerator)
    del accelerator._optimizers
    with changed("accelerate", r"Accelerator\._optimizers"):
        acc.prepared_optimizers(accelerator)


def test_accelerate_loads_prepared_models_through_their_load_state_dict(monkeypatch):
    import accelerate.checkpointing as checkpointing

    acc.check_models_loaded_through_load_state_dict()
    monkeypatch.setattr(checkpointing, "load_accelerator_state", lambda input_dir, models, *args, **kwargs: None)
    with changed("accelerate", r"load_accelerator_state"):
        acc.check_models_loaded_through_load_state_dict()


def test_the_dynamo_backend_roundpipe_refuses(monkeypatch):
    import accelerate
    from accelerate.state import AcceleratorState
    from accelerate.utils import DynamoBackend

    accelerator = accelerate.Accelerator(cpu=True)
    assert acc.dynamo_backend(accelerator) == DynamoBackend.NO
    monkeypatch.setattr(AcceleratorState, "__init__", lambda self, *args, **kwargs: None)  # sets no dynamo_plugin
    with changed("accelerate", r"dynamo_plugin"):
        acc.dynamo_backend(accelerator)


def test_accelerate_state_reset(monkeypatch):
    from accelerate.state import GradientState

    acc.reset_accelerate_state()
    monkeypatch.delattr(GradientState, "_reset_state")
    with changed("accelerate", r"_reset_state"):
        acc.reset_accelerate_state()


# ---------------------------------------------------------------------- the user's model: torch, transformers, PEFT


def test_methods_patched_on_the_instance_and_restored():
    model = nn.Linear(2, 2)
    own = model.forward
    originals = hf_models.patch_methods(model, {"forward": lambda x: "patched"})
    assert model(torch.zeros(2)) == "patched" and originals == {"forward": None}
    hf_models.restore_methods(model, originals)
    assert "forward" not in model.__dict__ and model.forward == own


def test_a_module_that_stores_set_methods_elsewhere_is_refused():
    class Elsewhere(nn.Linear):
        def __setattr__(self, name, value):
            if name == "forward":
                self.__dict__["_stored_forward"] = value  # not where attribute lookup looks
            else:
                super().__setattr__(name, value)

    with changed("torch", r"Elsewhere\.forward"):
        hf_models.patch_methods(Elsewhere(2, 2), {"forward": lambda x: x})


def test_the_class_method_behind_a_patched_one():
    model = tiny_llama()
    assert hf_models.class_method(model, "generate").__func__ is type(model).generate
    with changed("transformers", r"Linear\.generate"):
        hf_models.class_method(nn.Linear(2, 2), "generate")


def test_zero_grad_replacement_matches_torch(monkeypatch):
    hf_models.check_zero_grad_replacement()
    monkeypatch.setattr(nn.Module, "zero_grad", lambda self: None)
    with changed("torch", r"zero_grad"):
        hf_models.check_zero_grad_replacement()


def test_save_pretrained_calls_are_read_by_the_class_signature():
    model = tiny_llama()
    call = hf_models.save_pretrained_call(model, ("out", False), {})
    assert (call.save_directory, call.is_main_process, call.gives_state_dict, call.state_dict_positional) == \
        ("out", False, False, False)
    call = hf_models.save_pretrained_call(model, ("out", True, {"w": 1}), {})
    assert call.gives_state_dict and call.state_dict_positional
    call = hf_models.save_pretrained_call(model, (), {"save_directory": "out", "state_dict": {"w": 1}})
    assert call.gives_state_dict and not call.state_dict_positional


def test_save_pretrained_of_a_peft_model_is_read_by_its_own_signature():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    # PEFT's second parameter is `safe_serialization`, and `is_main_process` and `state_dict` come by keyword.
    call = hf_models.save_pretrained_call(model, ("out", True), {"is_main_process": False, "state_dict": {"w": 1}})
    assert (call.save_directory, call.is_main_process, call.gives_state_dict) == ("out", False, True)


def test_a_save_pretrained_without_a_state_dict_is_refused():
    class Saves(nn.Module):
        def save_pretrained(self, save_directory, is_main_process=True):
            pass

    with changed("transformers", r"Saves\.save_pretrained"):
        hf_models.save_pretrained_call(Saves(), ("out",), {})


def test_adapters_loaded_through_transformers(monkeypatch):
    from transformers import PreTrainedModel

    model = tiny_llama()
    assert not hf_models.has_transformers_adapters(model)
    model._hf_peft_config_loaded = True
    assert hf_models.has_transformers_adapters(model)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", lambda self, save_directory: None)
    with changed("transformers", r"_hf_peft_config_loaded"):
        hf_models.has_transformers_adapters(model)


# ---------------------------------------------------------------------- TRL


@pytest.fixture
def trl():
    return pytest.importorskip("trl", reason="TRL is not installed (pip install trl; it is in the test extras)")


def test_trl_trainers_are_transformers_trainers_that_call_roundpipes_methods(trl, monkeypatch):
    from transformers import Trainer

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    for name in ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer"):
        assert trl_internals.trl_trainer(name, Trainer, RoundPipeTrainer) is getattr(trl, name)

    def _save_checkpoint(self, model, trial):  # saves by itself: RoundPipe's staged save would never run
        return None

    monkeypatch.setattr(trl.SFTTrainer, "_save_checkpoint", _save_checkpoint)
    with changed("trl", r"SFTTrainer\._save_checkpoint"):
        trl_internals.trl_trainer("SFTTrainer", Trainer, RoundPipeTrainer)
    monkeypatch.setattr(trl, "SFTTrainer", type("SFTTrainer", (), {}))
    with changed("trl", r"trl\.SFTTrainer"):
        trl_internals.trl_trainer("SFTTrainer", Trainer, RoundPipeTrainer)


def test_the_fused_output_class(trl, monkeypatch):
    import trl.trainer.utils as utils

    assert trl_internals.fused_output_class() is utils.FusedCausalLMOutput
    monkeypatch.delattr(utils, "FusedCausalLMOutput")
    with changed("trl", r"FusedCausalLMOutput"):
        trl_internals.fused_output_class()


def test_the_temperature_trl_closes_over_is_read(trl):
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama()
    assert trl_internals.fused_head_setting(model, model.__dict__.get("forward"), "temperature", 1.0) == 1.0
    add_fused_lm_head(model, temperature=0.5)
    assert trl_internals.fused_head_setting(model, model.__dict__["forward"], "temperature", 1.0) == 0.5


def test_a_fused_head_that_no_longer_closes_over_its_temperature_is_refused(trl, monkeypatch):
    import trl.trainer.utils as utils

    model = tiny_llama()
    utils.add_fused_lm_head(model, temperature=0.5)

    def add_fused_lm_head(model, temperature=1.0):  # keeps it somewhere else
        model.fused_temperature = temperature

        def _fused_forward(self, *args, **kwargs):
            return None

        return _fused_forward

    monkeypatch.setattr(utils, "add_fused_lm_head", add_fused_lm_head)
    with changed("trl", r"add_fused_lm_head"):
        trl_internals.fused_head_setting(model, model.__dict__["forward"], "temperature", 1.0)


def test_a_fused_head_setting_it_does_not_close_over_is_refused(trl):
    import types

    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama()
    add_fused_lm_head(model, temperature=0.5)
    with changed("trl", r"`no_such_setting` add_fused_lm_head closes over"):
        trl_internals.fused_head_setting(model, model.__dict__["forward"], "no_such_setting", 1.0)
    # Why a forward of TRL's code is never without its closure: Python builds no such function.
    with pytest.raises((TypeError, ValueError)):
        types.FunctionType(trl_internals.fused_forward_code(), {})


@pytest.mark.parametrize("peft_policy", [False, True], ids=["plain", "peft"])
def test_a_fused_head_at_another_temperature_is_refused_by_the_engine(trl, peft_policy):
    """TRL patches a PEFT policy's base model (GRPO, DPO): its temperature is read from there too; it was read as 1
    (the default), so log-probabilities at the wrong temperature went unnoticed."""
    from trl.trainer.utils import add_fused_lm_head

    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    model = tiny_llama()
    add_fused_lm_head(model, temperature=0.5)
    if peft_policy:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    try:
        batch = lm_batch()
        with pytest.raises(ValueError, match="temperature=0.5"):
            model(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True)
    finally:
        engine.close()


# ---------------------------------------------------------------------- torch


def test_the_default_group_timeout_is_set_through_the_private_setter(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    # in a fresh process: runs whether or not another test left a group up here
    before, after = default_group_timeout_around(
        "torch_internals.set_default_group_timeout(datetime.timedelta(seconds=7))")
    assert before != 7 and after == 7
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda timeout: None)  # the group no longer taken
    with changed("torch", r"_set_pg_timeout"):
        torch_internals.set_default_group_timeout(datetime.timedelta(seconds=7))
    monkeypatch.delattr(c10d, "_set_pg_timeout")
    with changed("torch", r"_set_pg_timeout"):
        torch_internals.set_default_group_timeout(datetime.timedelta(seconds=7))


def test_the_scheduler_learns_of_a_step_taken_elsewhere(monkeypatch):
    from torch.optim.lr_scheduler import LRScheduler, StepLR

    weight = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = StepLR(optimizer, step_size=1)
    torch_internals.mark_stepped_for_scheduler(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would be raised
        scheduler.step()
    monkeypatch.setattr(LRScheduler, "step", lambda self, epoch=None: None)
    with changed("torch", r"_opt_called"):
        torch_internals.mark_stepped_for_scheduler(optimizer)


def test_the_backward_node_class_of_an_autograd_function():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    out = Double.apply(torch.ones(1, requires_grad=True))
    assert type(out.grad_fn) is torch_internals.backward_node_class(Double)
    with changed("torch", r"_backward_cls"):  # as a Function would be, were torch to name its node otherwise
        torch_internals.backward_node_class(type("Double", (), {}))


def test_to_arguments_are_read_as_torch_reads_them(monkeypatch):
    assert torch_internals.parse_to_arguments("cpu")[:2] == (torch.device("cpu"), None)
    assert torch_internals.parse_to_arguments(dtype=torch.float16)[1] == torch.float16
    monkeypatch.setattr(torch._C._nn, "_parse_to", lambda *args, **kwargs: (None, None))
    with changed("torch", r"_parse_to"):
        torch_internals.parse_to_arguments("cpu")


# ---------------------------------------------------------------------- the stock-script launcher


def test_every_name_the_launcher_swaps_holds_the_class_roundpipe_builds_on():
    from accelerate_roundpipe.launch.install import _targets

    for module_name, attribute, replacement in _targets():
        launcher_swaps.swap_target(module_name, attribute, replacement)


def test_a_launcher_target_moved_or_renamed_is_refused_before_anything_is_swapped(monkeypatch):
    import accelerate
    import transformers

    from accelerate_roundpipe.launch.install import install, is_installed

    monkeypatch.setattr(transformers, "TrainingArguments", type("TrainingArguments", (), {}))
    with changed("transformers", r"transformers\.TrainingArguments"):
        install()
    assert not is_installed() and accelerate.Accelerator is acc.original_accelerator()
    monkeypatch.delattr(accelerate, "Accelerator")
    with changed("accelerate", r"accelerate\.Accelerator"):
        launcher_swaps.swap_target("accelerate", "Accelerator", object)


# ---------------------------------------------------------------------- the callers reach through compat


def test_the_default_group_timeout_follows_wait_timeout_through_compat(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from accelerate_roundpipe.integrations import multi_process

    # in a fresh process: runs whether or not another test left a group up here
    before, after = default_group_timeout_around("multi_process.follow_wait_timeout(7.0)")
    assert before != 7 and after == 7
    # The refusal needs a live group (without one there is nothing to follow) and comes before the setter is called:
    # a group another test left up serves and is not changed.
    with default_group_up():
        monkeypatch.setattr(c10d, "_set_pg_timeout", lambda timeout: None)  # the group no longer taken
        with changed("torch", r"_set_pg_timeout"):
            multi_process.follow_wait_timeout(7.0)


def test_the_engines_autograd_nodes_are_recognised_through_compat(monkeypatch):
    from accelerate_roundpipe.integrations import multi_process
    from accelerate_roundpipe.runtime.execution.deferred import DeferredLoss

    loss = torch.ones(2, requires_grad=True).sum()
    assert multi_process.loss_kind(loss) == multi_process.OTHER
    monkeypatch.delattr(DeferredLoss, "_backward_cls")  # as it would be, were torch to name its node otherwise
    with changed("torch", r"_backward_cls"):
        multi_process.loss_kind(loss)


def test_the_trainers_num_processes_factor_is_checked(monkeypatch):
    import transformers

    from accelerate_roundpipe.integrations import multi_process

    assert multi_process.trainer_loss_multiplier(True, True, 10, 4) == 4
    assert multi_process.trainer_loss_multiplier(True, True, 10, 4, tp_size=2) == 2
    assert multi_process.trainer_loss_multiplier(True, True, 10, 4, n_gpu=3) == 3
    assert multi_process.trainer_loss_multiplier(True, False, 10, 4) == 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss  # a Trainer that no longer undoes DDP's mean

    monkeypatch.setattr(transformers.Trainer, "compute_loss", compute_loss)
    with changed("transformers", r"num_processes factor of Trainer.compute_loss"):
        multi_process.trainer_loss_multiplier(True, True, 10, 4)


def test_the_collective_device_reads_accelerates_backend_checked():
    from types import SimpleNamespace

    from accelerate_roundpipe.integrations import multi_process

    assert multi_process.collective_device(SimpleNamespace(backend="gloo", device=torch.device("cuda", 0))) == \
        torch.device("cpu")
    assert multi_process.collective_device(SimpleNamespace(backend=None, device=torch.device("cpu"))) == \
        torch.device("cpu")
    assert multi_process.collective_device(SimpleNamespace(backend="nccl", device=torch.device("cuda", 1))) == \
        torch.device("cuda", 1)
    with changed("accelerate", r"PartialState.backend"):  # a state whose backend moved: not "no backend"
        multi_process.collective_device(SimpleNamespace(device=torch.device("cuda", 1)))


def test_the_scheduler_flag_is_set_by_roundpipes_step_through_compat(monkeypatch):
    from torch.optim.lr_scheduler import LRScheduler

    from accelerate_roundpipe import RoundPipe, RoundPipeConfig

    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4)), RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        engine.forward_backward(torch.randn(2, 4), labels=torch.randn(2, 4), loss_fn=nn.functional.mse_loss)
        optimizer.step()
        assert optimizer.inner._opt_called
        engine.forward_backward(torch.randn(2, 4), labels=torch.randn(2, 4), loss_fn=nn.functional.mse_loss)
        monkeypatch.setattr(LRScheduler, "step", lambda self, epoch=None: None)
        with changed("torch", r"_opt_called"):
            optimizer.step()
    finally:
        engine.close()


def test_the_late_grad_norm_measures_through_compat(monkeypatch):
    import threading
    from types import SimpleNamespace

    from accelerate_roundpipe.integrations.grad_norm import STEP_TAG, LateGradNorm

    weight = nn.Parameter(torch.zeros(3))
    weight.grad = torch.tensor([3.0, 0.0, 4.0])
    stepper = SimpleNamespace(param_groups=[{"params": [weight], STEP_TAG: 5}])
    late = SimpleNamespace(_lock=threading.Lock(), _squares={}, _seen={})
    LateGradNorm._measure(late, stepper, (), {})
    assert late._squares == {5: pytest.approx(25.0)} and late._seen == {5: 1}
    monkeypatch.delattr(torch, "_foreach_norm")
    with changed("torch", r"torch._foreach_norm"):
        LateGradNorm._measure(late, stepper, (), {})


def test_accelerates_optimizer_wrapper_is_built_with_the_parameters_roundpipe_passes(monkeypatch):
    from accelerate.optimizer import AcceleratedOptimizer

    from accelerate_roundpipe.integrations.optimizer import RoundPipeAcceleratedOptimizer

    acc.check_accelerated_optimizer_init()

    def init(self, optimizer, device_placement=True):  # a wrapper without the scaler
        self.optimizer = optimizer

    monkeypatch.setattr(AcceleratedOptimizer, "__init__", init)
    with changed("accelerate", r"AcceleratedOptimizer.__init__"):
        RoundPipeAcceleratedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
