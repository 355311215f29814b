"""Math check functions that hang or crash, for the worker-pool tests. They live in their own module
so spawned worker processes can import them (the parent's sys.path is passed to the workers)."""

from __future__ import annotations

import os
import time

from everstep_reward.verifiers.math import MathCheck, check_math_answer


def hang_or_check(response: str, reference: str) -> MathCheck:
    if "HANG" in response:
        time.sleep(600)
    if "CRASH" in response:
        os._exit(1)
    return check_math_answer(response, reference)


def sleep_then_return(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def process_ids() -> tuple[int, int]:
    """(pid, session id) of the worker that runs it."""
    return os.getpid(), os.getsid(0)
