"""benchmarks/stack_sampler.py: a thread's time is found in the function it spends it in."""

import threading
import time

from benchmarks.stack_sampler import StackSampler


def _spin_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def test_samples_name_the_function_each_thread_is_in():
    sampler = StackSampler(0.002)
    sampler.start()
    sleeper = threading.Thread(target=_sleep_for, args=(0.3,), name="sleeper")
    sleeper.start()
    _spin_for(0.3)
    sleeper.join()
    sampler.stop()
    main, other = threading.main_thread().name, "sleeper"
    assert sampler.samples[main] >= 10 and sampler.samples[other] >= 10
    spun = sampler.inside[main]["test_benchmarks_stack_sampler.py:_spin_for"] / sampler.samples[main]
    slept = sampler.leaf[other]["test_benchmarks_stack_sampler.py:_sleep_for"] / sampler.samples[other]
    assert spun > 0.8 and slept > 0.8, (spun, slept)
    text = sampler.report()
    assert "thread sleeper" in text and "_spin_for" in text
