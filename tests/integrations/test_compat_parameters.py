"""The signature checks of compat ([Note: compatibility reaches]): a parameter RoundPipe passes that moved, or a new
one RoundPipe's call lacks, is refused; what RoundPipe's call still fits passes."""

from __future__ import annotations

import pytest

from accelerate_roundpipe.compat import LibraryChangedError, require_parameters


def check(function, names=("model", "trial"), **options):
    require_parameters(function, names, "transformers", "Trainer._save_checkpoint", **options)


def test_leading_parameters_followed_by_optional_ones_pass():
    check(lambda self, model, trial: None)
    check(lambda self, model, trial, metrics=None: None)
    check(lambda self, model, trial, *args, metrics=None, **kwargs: None)


def test_a_required_parameter_after_the_leading_ones_is_refused():
    """RoundPipe passes the leading parameters only: a new required one would make its call raise a TypeError."""
    with pytest.raises(LibraryChangedError, match=r"requires \(metrics\)"):
        check(lambda self, model, trial, metrics: None)
    with pytest.raises(LibraryChangedError, match=r"requires \(metrics\)"):
        check(lambda self, model, trial, *, metrics: None)  # keyword-only: as missing from the call


def test_leading_parameters_moved_are_refused():
    with pytest.raises(LibraryChangedError, match=r"takes \(trial, model\)"):
        check(lambda self, trial, model: None)


def test_parameters_anywhere_ignore_others_required():
    """Not leading: the names are read by keyword from a call RoundPipe does not build (`save_pretrained`'s)."""
    check(lambda self, other, trial, model: None, leading=False)
    with pytest.raises(LibraryChangedError, match=r"takes \(other, model\)"):
        check(lambda self, other, model: None, leading=False)


# ---------------------------------------------------------------------- overrides listed with `()`


def test_an_override_listed_with_no_parameters_is_checked_like_any_other(monkeypatch):
    """`()`: RoundPipe calls the base method with no parameter, so a required one it gained is refused, like a
    parameter moved in a method listed with some (these entries were skipped: an empty tuple is false)."""
    from transformers import Trainer

    from accelerate_roundpipe.compat import hf_trainer
    from accelerate_roundpipe.integrations.trainer import RoundPipeTrainer

    assert hf_trainer.TRAINER_OVERRIDES["create_accelerator_and_postprocess"] == ()
    hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)
    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", lambda self, plugin: None)
    with pytest.raises(LibraryChangedError, match=r"create_accelerator_and_postprocess.*requires \(plugin\)"):
        hf_trainer.check_trainer_overrides(RoundPipeTrainer, Trainer)


def test_an_override_listed_with_no_parameters_must_still_be_a_method():
    from accelerate_roundpipe.compat import check_overrides

    class Base:
        def finish(self):
            pass

    class Ours(Base):
        def finish(self):
            super().finish()

    check_overrides(Ours, Base, {"finish": ()}, "accelerate")
    Base.finish = None  # a data attribute now: RoundPipe's override would replace no method
    with pytest.raises(LibraryChangedError, match=r"Base\.finish.*signature cannot be read"):
        check_overrides(Ours, Base, {"finish": ()}, "accelerate")
    check_overrides(Ours, Base, {"finish": None}, "accelerate")  # None: existence only, as before
    del Base.finish
    with pytest.raises(LibraryChangedError, match=r"no `finish` any more"):
        check_overrides(Ours, Base, {"finish": ()}, "accelerate")
