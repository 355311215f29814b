"""An optional record of what the trainer trained on: one JSON line per applied train step.

Enabled by `--sample-log PATH` (or the environment variable EVERSTEP_TRAINER_SAMPLE_LOG, which
the trainers a launcher starts inherit); `{pid}` in the path is replaced by the process id, so
trainers started with one environment write separate files. A line is
`{"version": V, "loss": L, "grad_norm": G, "samples": [{"prompt_ids": [...], "output_ids": [...],
"reward": R, "advantage": A}, ...]}` with V the policy version after the step. It answers "which
samples did this policy see, and how often" from the trainer's side (the fault tests count
prompts with it, docs/reliability.md) at the cost of writing each batch's token ids once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from everstep.v1 import trainer_pb2

__all__ = ["SAMPLE_LOG_ENV", "SampleLog"]

SAMPLE_LOG_ENV = "EVERSTEP_TRAINER_SAMPLE_LOG"


class SampleLog:
    def __init__(self, path: str) -> None:
        self.path = Path(path.replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, version: int, stats: trainer_pb2.TrainStats, request: trainer_pb2.TrainStepRequest) -> None:
        samples = [{"prompt_ids": list(s.prompt_ids), "output_ids": list(s.output_ids), "reward": s.reward,
                    "advantage": s.advantage} for s in request.samples]
        line = json.dumps({"version": version, "loss": stats.loss, "grad_norm": stats.grad_norm, "samples": samples})
        # one write of a whole line with O_APPEND: a trainer killed mid-way leaves whole lines only
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
