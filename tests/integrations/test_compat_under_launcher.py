"""Under the stock-script launcher `transformers.Trainer` is `RoundPipeTrainer` (`launch/install.py`): compat's
checks of the Trainer ([Note: compatibility reaches]) must still read transformers' own code, not RoundPipe's,
whose overrides mention every name the checks look for."""

from __future__ import annotations

import pytest

from accelerate_roundpipe.compat import LibraryChangedError, hf_trainer


def test_the_compute_loss_check_reads_transformers_trainer_under_the_launcher(monkeypatch):
    import importlib

    import transformers.trainer as trainer_module
    import transformers.training_args as training_args_module

    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer
    from accelerate_roundpipe.launch.install import installed

    own, own_arguments = trainer_module.Trainer, training_args_module.TrainingArguments
    transformers = importlib.import_module("transformers")  # the package as scripts import it (sys.modules')

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss  # a Trainer that no longer undoes DDP's mean

    with installed():
        assert transformers.Trainer is RoundPipeTrainer and trainer_module.Trainer is RoundPipeTrainer
        assert hf_trainer.compute_loss_process_factor(True, True, 10, 4) == 4
        monkeypatch.setattr(own, "compute_loss", compute_loss)
        # Read through `transformers.Trainer`, the check found RoundPipeTrainer.compute_loss and passed.
        with pytest.raises(LibraryChangedError, match=r"num_processes factor of Trainer\.compute_loss"):
            hf_trainer.compute_loss_process_factor(True, True, 10, 4)
        assert hf_trainer.original_trainer() is own
        assert hf_trainer.original_training_arguments() is own_arguments
    assert transformers.Trainer is own and hf_trainer.original_trainer() is own


def test_a_trainer_name_holding_no_class_of_transformers_is_refused(monkeypatch):
    import transformers.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "Trainer", type("Trainer", (), {}))  # defined elsewhere
    with pytest.raises(LibraryChangedError, match=r"transformers\.trainer\.Trainer.*no class Trainer defined"):
        hf_trainer.original_trainer()
