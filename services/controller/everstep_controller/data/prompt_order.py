"""The order in which a job draws training prompts, reproducible from (seed, epoch, cursor).

Each pass over the dataset (an epoch) is a shuffle seeded by the job's seed and the epoch
number, so the whole order is a function of three integers: a job restored from Redis draws
exactly the prompts it would have drawn had it never stopped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PromptOrder:
    num_rows: int
    seed: int
    epoch: int = 0
    cursor: int = 0  # prompts of this epoch already drawn

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError("a prompt order needs at least one row")
        if not 0 <= self.cursor <= self.num_rows:
            raise ValueError(f"cursor {self.cursor} outside 0..{self.num_rows}")
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self) -> int:
        """Position (in the loaded rows) of the next prompt."""
        if self.cursor >= self.num_rows:
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffled(self.epoch)
        position = self._order[self.cursor]
        self.cursor += 1
        return position
