"""Exponential backoff between retries, with jitter so that many retriers do not move in step."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Backoff:
    initial_seconds: float = 0.5
    """Pause after the first failure."""
    max_seconds: float = 30.0
    """Longest pause: the pause doubles per failure up to this."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_seconds <= self.max_seconds:
            raise ValueError(f"need 0 < initial_seconds ({self.initial_seconds}) <= max_seconds ({self.max_seconds})")

    def seconds(self, failures: int) -> float:
        """The pause after `failures` failures in a row (>= 1): between half and all of the capped doubling."""
        ceiling = min(self.max_seconds, self.initial_seconds * 2 ** max(0, failures - 1))
        return ceiling * (0.5 + 0.5 * random.random())
