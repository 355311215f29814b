"""Signal-aware sampling (`algorithm.min_signal_groups`, DAPO's dynamic sampling) through real processes
(the fault tests' harness: a controller, a reward service and each job's own workers).

A sync step starts 2 groups per round; asking for 3 groups with a signal makes every step take at
least a second round, and at most `max_sampling_rounds`. Every step reports its rounds, and the
rollouts it generated, scored and trained agree with them; the trainer's own log holds only groups
whose rewards differ.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from fault_helpers import Controllers, arithmetic_rows, sample_log_lines, tiny_job, wait_job, write_rows

pytestmark = pytest.mark.faults

STEPS, PROMPTS, GROUP_SIZE, MIN_SIGNAL, MAX_ROUNDS = 4, 2, 4, 3, 3


def test_a_step_samples_more_rounds_until_it_holds_enough_groups_with_a_signal(
        controllers: Controllers, tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "trained.jsonl"
    controllers.start(env={"EVERSTEP_TRAINER_SAMPLE_LOG": str(log)})
    api = controllers.api
    train = write_rows(tmp_path / "train.jsonl", arithmetic_rows(12))
    spec = tiny_job("signal", tiny_model_dir, train, steps=STEPS, sampling={"max_new_tokens": 8, "stop": ["1"]},
                    algorithm={"group_size": GROUP_SIZE, "drop_zero_signal_groups": True,
                               "min_signal_groups": MIN_SIGNAL, "max_sampling_rounds": MAX_ROUNDS})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    assert job["step"] == STEPS

    history = api.get(f"/v1/jobs/{job_id}/metrics").json()
    for m in history:
        rounds = m["num_sampling_rounds"]
        assert 2 <= rounds <= MAX_ROUNDS, "one round holds only 2 groups; never past the last round"
        assert m["num_finished_rollouts"] == rounds * PROMPTS * GROUP_SIZE, "each round one batch of prompts"
        groups = m["num_groups_trained"] + m["num_groups_zero_signal"] + m["num_groups_unscorable"]
        assert groups + m["num_groups_dropped"] == rounds * PROMPTS, "every group of every round accounted for"
        assert m["num_groups_trained"] >= MIN_SIGNAL or rounds == MAX_ROUNDS
        assert m["num_samples_trained"] == m["num_groups_trained"] * GROUP_SIZE

    steps = sample_log_lines(log)
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    for step, m in zip(steps, history, strict=True):
        groups = collections.defaultdict(list)
        for sample in step["samples"]:
            groups[tuple(sample["prompt_ids"])].append(sample["reward"])
        assert len(step["samples"]) == m["num_samples_trained"]
        assert all(len(set(rewards)) > 1 for rewards in groups.values()), "only groups whose rewards differ"
