"""benchmarks/run.py: the median-step rate is reported only where there are enough timed steps for a median to
mean the step's pace (one step's unsynchronized wall time does not)."""

from benchmarks.run import MIN_STEPS_FOR_MEDIAN, median_step_tokens_per_s


def test_the_median_of_several_timed_steps():
    assert median_step_tokens_per_s([2.0, 1.0, 4.0], 1000) == 500.0


def test_too_few_timed_steps_give_no_figure():
    assert MIN_STEPS_FOR_MEDIAN == 3
    assert median_step_tokens_per_s([1.29], 32768) is None
    assert median_step_tokens_per_s([1.0, 1.1], 32768) is None
