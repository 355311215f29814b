"""Generated tokens per second over a sliding window, as both engines report it."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ThroughputWindow:
    """Tokens per second over a sliding window of (end_time, num_tokens) events."""

    window_seconds: float
    events: collections.deque = field(default_factory=collections.deque)  # (end_time, num_tokens)

    def record(self, end_time: float, num_tokens: int) -> None:
        self.events.append((end_time, num_tokens))

    def tokens_per_second(self, now: float) -> float:
        while self.events and self.events[0][0] < now - self.window_seconds:
            self.events.popleft()
        if len(self.events) < 2:
            return 0.0
        span = now - self.events[0][0]
        return sum(n for _, n in list(self.events)[1:]) / span if span > 0 else 0.0
