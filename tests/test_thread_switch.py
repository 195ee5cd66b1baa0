"""[Note: GIL switch interval]: shortened from CPython's default, a value the user chose kept."""

from __future__ import annotations

import sys

import pytest

from accelerate_roundpipe.runtime import thread_switch


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_default_interval_is_shortened(restore_interval):
    sys.setswitchinterval(thread_switch.CPYTHON_DEFAULT_S)
    assert thread_switch.use_short_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(thread_switch.SWITCH_INTERVAL_S)


def test_an_interval_the_user_set_stands(restore_interval):
    sys.setswitchinterval(0.002)
    assert not thread_switch.use_short_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.002)
