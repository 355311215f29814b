"""Exponential backoff between retries, with jitter so that many retriers do not move in step."""

from __future__ import annotations

import random
from dataclasses import dataclass

from everstep_controller.settings import ControllerSettings, check_backoff, check_settings, from_settings, setting


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Defaults and checks: the controller's --retry-initial-seconds and --retry-max-seconds (`ControllerSettings`)."""

    initial_seconds: float = setting("retry_initial_seconds")
    """Pause after the first failure."""
    max_seconds: float = setting("retry_max_seconds")
    """Longest pause: the pause doubles per failure up to this."""

    def __post_init__(self) -> None:
        check_settings(self)
        check_backoff(self.initial_seconds, self.max_seconds, names=("initial_seconds", "max_seconds"))

    @classmethod
    def from_settings(cls, settings: ControllerSettings) -> Backoff:
        return from_settings(cls, settings)

    def seconds(self, failures: int) -> float:
        """The pause after `failures` failures in a row (>= 1): between half and all of the capped doubling."""
        ceiling = min(self.max_seconds, self.initial_seconds * 2 ** max(0, failures - 1))
        return ceiling * (0.5 + 0.5 * random.random())
