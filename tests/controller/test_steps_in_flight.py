"""The steps a runner has in flight with scheduler.overlap: run in order on one thread, joined down to a
depth, and after a failure the ones behind it are skipped and the failure raised once all ended."""

from __future__ import annotations

import threading

import pytest

from everstep_controller.run.steps_in_flight import StepsInFlight


def test_steps_run_in_order_and_join_keeps_the_newest() -> None:
    steps = StepsInFlight("job")
    done: list[int] = []
    release = threading.Event()

    def step(n: int) -> None:
        release.wait(10)
        done.append(n)

    try:
        for n in range(3):
            steps.submit(lambda n=n: step(n))
        assert len(steps) == 3 and done == [], "queued behind the first, which waits"
        release.set()
        steps.join(keep=1)
        assert len(steps) == 1 and done[:2] == [0, 1]
        steps.join()
        assert len(steps) == 0 and done == [0, 1, 2]
    finally:
        steps.shutdown()


def test_a_failed_step_skips_those_behind_it_and_join_raises_it_once_all_ended() -> None:
    steps = StepsInFlight("job")
    done: list[int] = []

    def fail() -> None:
        raise RuntimeError("trainer at 127.0.0.1:1 failed TrainStep")

    try:
        steps.submit(lambda: done.append(0))
        steps.submit(fail)
        steps.submit(lambda: done.append(2))
        with pytest.raises(RuntimeError, match="failed TrainStep"):
            steps.join()
        assert done == [0] and len(steps) == 0, "the step behind the failed one did not train"
        steps.submit(lambda: done.append(3))  # after a failure is handled, new steps run again
        steps.join()
        assert done == [0, 3]
        steps.submit(fail)
        steps.settle()  # ends whatever the steps end with, and raises nothing
        assert len(steps) == 0
    finally:
        steps.shutdown()
