"""The trainer's optional sample log: one whole JSON line per applied train step, one file per process."""

from __future__ import annotations

import json
import os
from pathlib import Path

from everstep.v1 import trainer_pb2
from everstep_trainer.sample_log import SampleLog


def test_each_step_is_one_line_with_its_samples(tmp_path: Path) -> None:
    log = SampleLog(str(tmp_path / "logs" / "trainer-{pid}.jsonl"))
    assert log.path == tmp_path / "logs" / f"trainer-{os.getpid()}.jsonl"
    request = trainer_pb2.TrainStepRequest(samples=[
        trainer_pb2.TrainSample(prompt_ids=[1, 2], output_ids=[3], reward=0.5, advantage=-1.0),
        trainer_pb2.TrainSample(prompt_ids=[1, 2], output_ids=[4, 5], reward=1.0, advantage=1.0)])
    log.append(1, trainer_pb2.TrainStats(loss=0.25, grad_norm=2.0), request)
    log.append(2, trainer_pb2.TrainStats(loss=-0.125, grad_norm=1.5), request)
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(line["version"], line["loss"], line["grad_norm"]) for line in lines] == [(1, 0.25, 2.0), (2, -0.125, 1.5)]
    assert lines[0]["samples"] == [{"prompt_ids": [1, 2], "output_ids": [3], "reward": 0.5, "advantage": -1.0},
                                   {"prompt_ids": [1, 2], "output_ids": [4, 5], "reward": 1.0, "advantage": 1.0}]
