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
