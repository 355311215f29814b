"""An optional record of what the reward service scored: one JSON line per item.

Enabled by `--item-log PATH` (or the environment variable EVERSTEP_REWARD_ITEM_LOG, which the reward
service `everstep up` starts inherits); `{pid}` in the path is replaced by the process id. A line is
`{"id": ..., "prompt": ..., "response": ..., "reward": R, "error": ...}`: exactly the text the
verifiers read, for checking what a job sends them (the decoded completion, without the chat
template's control tokens) and for auditing rewards. It writes every response once; leave it off for
large jobs.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from everstep.v1 import reward_pb2

__all__ = ["ITEM_LOG_ENV", "ItemLog"]

ITEM_LOG_ENV = "EVERSTEP_REWARD_ITEM_LOG"


class ItemLog:
    def __init__(self, path: str) -> None:
        self.path = Path(path.replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # Score calls run on several gRPC threads

    def append(self, item: reward_pb2.RewardItem, result: reward_pb2.ScoreResult) -> None:
        line = json.dumps({"id": item.id, "prompt": item.prompt, "response": item.response, "reward": result.reward,
                           "error": result.error})
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")
