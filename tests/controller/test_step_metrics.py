"""The per-step metrics row and the evaluation: typed models whose JSON is the REST contract the dicts
they replaced defined, field for field; rows and records stored by that code still validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from everstep.rest.job_record import JobRecord
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import REWARD_KL_FIELDS, TOOL_FIELDS, TRAIN_STAT_FIELDS, Evaluation, StepMetrics
from everstep.v1 import trainer_pb2
from everstep_controller.algo.reward_kl import RewardKl
from everstep_controller.algo.scheduler import IterationOutcome
from everstep_controller.algo.training_batch import TrainingBatch
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.run.step_record import StepTimes, step_record
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import JobProgress, ProgressStore
from everstep_controller.tracking.trackers import step_values

# A row as the dict-building step_record wrote it (json.dumps) for a step without a trained batch.
OLD_UNTRAINED_ROW = {
    "step": 3, "policy_version": 2, "reward_mean": 0.0, "num_samples_scored": 0, "num_samples_trained": 0,
    "num_trained_samples_total": 16, "num_groups_trained": 0, "num_groups_zero_signal": 2,
    "num_groups_unscorable": 0, "num_samples_unscorable": 0, "num_groups_dropped": 0, "num_samples_purged": 1,
    "partial_buffer_size": 3, "num_finished_rollouts": 8, "finished_tokens": 96, "generated_tokens": 120,
    "tokens_per_s": 60.0, "staleness_mean": 0.0, "staleness_max": 0, "rollout_seconds": 2.0,
    "reward_seconds": 0.25, "train_seconds": 0.0, "weight_push_seconds": 0.0, "iteration_seconds": 2.5,
}
# Fields added since (additive REST changes), with the value a row stored before them reads back with.
ADDED = {"num_sampling_rounds": 1, "num_samples_truncated_masked": 0}
OLD_TRAIN_STATS = {"loss": -0.125, "grad_norm": 1.5, "masked_fraction": 0.25, "mismatch_kl": 0.001,
                   "logp_diff_abs_mean": 0.01, "logp_diff_max": 0.5, "clip_fraction": 0.0, "entropy": 1.25,
                   "learning_rate": 1e-06}
STALENESS_STATS = {"masked_fraction_fresh": 0.0, "masked_fraction_stale": 0.5, "mismatch_kl_fresh": 0.0005,
                   "mismatch_kl_stale": 0.002, "num_tokens_fresh": 30, "num_tokens_stale": 10,
                   "padding_fraction": 0.25}
"""The mismatch split by token staleness, reported after the older statistics."""
ROUTING_STATS = {"routing_disagreement": 0.125, "routing_disagreement_fresh": 0.0625,
                 "routing_disagreement_stale": 0.25}
"""Mixture-of-experts routing mismatch, reported after those."""
SHARING_STATS = {"shared_prompt_fraction": 0.5}
"""Shared prompts (trainer.share_prompts), reported after those."""
KL_STATS = {"reference_kl": 0.0625, "kl_coef": 0.125}
"""The KL term in the loss (trainer.kl_coef), reported last."""


def _record(stats: trainer_pb2.TrainStats | None, reward_kl: RewardKl | None = None) -> StepMetrics:
    outcome = IterationOutcome(trainable_groups=["g0", "g1"], dropped_groups=[], purged_samples=["g2-0"],
                               carried_samples=["g3-0", "g3-1", "g3-2"], finished_tokens=96)
    times = StepTimes(rollout_seconds=2.0, reward_seconds=0.25, train_seconds=0.0, weight_push_seconds=0.0,
                      iteration_seconds=2.5)
    return step_record(step=3, version=2, outcome=outcome, batch=TrainingBatch(num_zero_signal=2, reward_kl=reward_kl),
                       rewards=[],
                       num_trained_samples_total=16, num_carried=3, num_finished=8, generated_tokens=120,
                       staleness=[], times=times, stats=stats)


def test_a_step_without_training_reports_what_the_dict_did_and_no_train_stats() -> None:
    record = _record(None)
    assert json.loads(record.model_dump_json()) == {**OLD_UNTRAINED_ROW, **ADDED}, "no train stat, not even null"
    assert record.model_dump() == {**OLD_UNTRAINED_ROW, **ADDED} and record.loss is None


def test_a_trained_step_reports_every_train_stat_of_the_trainer() -> None:
    record = _record(trainer_pb2.TrainStats(**OLD_TRAIN_STATS, **STALENESS_STATS, **ROUTING_STATS, **SHARING_STATS,
                                            **KL_STATS, num_tokens=40))
    assert json.loads(record.model_dump_json()) == {**OLD_UNTRAINED_ROW, **ADDED, **OLD_TRAIN_STATS,
                                                    **STALENESS_STATS, **ROUTING_STATS, **SHARING_STATS, **KL_STATS}
    assert list(record.model_dump()) == [*OLD_UNTRAINED_ROW, *ADDED, *OLD_TRAIN_STATS, *STALENESS_STATS,
                                         *ROUTING_STATS, *SHARING_STATS, *KL_STATS], \
        "the old key order, the new statistics after it"
    assert set(TRAIN_STAT_FIELDS) <= set(trainer_pb2.TrainStats.DESCRIPTOR.fields_by_name), \
        "each reported statistic is a TrainStats field of the same name"


def test_a_step_with_the_kl_in_the_reward_reports_its_kl_coefficient_and_mean_penalty() -> None:
    reward_kl = RewardKl(kl_coef=0.5, kl_mean=0.01, penalties={"g0-0": 0.25, "g0-1": 0.0, "g1-0": 0.125, "g1-1": 0.5},
                         seconds=0.75)
    row = json.loads(_record(None, reward_kl).model_dump_json())
    assert row == {**OLD_UNTRAINED_ROW, **ADDED, "reward_kl": 0.01, "reward_kl_coef": 0.5,
                   "reward_kl_penalty_mean": 0.21875, "reward_kl_seconds": 0.75}
    assert not set(REWARD_KL_FIELDS) & set(json.loads(_record(None).model_dump_json())), "left out without"
    assert {"reward_kl": 0.01, "reward_kl_coef": 0.5, "reward_kl_penalty_mean": 0.21875}.items() <= step_values(
        _record(None, reward_kl)).items(), "the experiment trackers get them too"


@pytest.mark.parametrize("row", [OLD_UNTRAINED_ROW, {**OLD_UNTRAINED_ROW, **OLD_TRAIN_STATS}])
def test_rows_stored_by_the_dict_code_validate_and_serialise_unchanged(row: dict) -> None:
    assert json.loads(StepMetrics.model_validate_json(json.dumps(row)).model_dump_json()) == {**row, **ADDED}


def test_a_row_missing_a_field_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="reward_mean"):
        StepMetrics.model_validate({k: v for k, v in OLD_UNTRAINED_ROW.items() if k != "reward_mean"})


def test_a_record_stored_before_the_models_validates(redis_url: str) -> None:
    """`metrics: {}` (no step yet) reads as None; a stored evaluation reads as an Evaluation."""
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})
    evaluation = {"0": {"step": 0, "accuracy": 0.25, "greedy_accuracy": None, "k": 4, "num_prompts": 8,
                        "num_unscored": 1}}
    old = {"id": "abc", "name": "n", "state": "RUNNING", "step": 0, "created_at": 1.0, "updated_at": 2.0,
           "error": None, "metrics": {}, "evaluation": evaluation, "dataset": None, "workers": None,
           "resumes": [], "spec": spec.model_dump(mode="json")}
    record = JobRecord.model_validate_json(json.dumps(old))
    assert record.metrics is None
    assert record.evaluation["0"] == Evaluation(step=0, accuracy=0.25, greedy_accuracy=None, k=4, num_prompts=8,
                                                num_unscored=1)
    added = {"pass_at_k": None, "maj_at_k": None}  # fields added since (additive REST changes)
    assert json.loads(record.model_dump_json())["evaluation"] == {"0": {**evaluation["0"], **added}}
    with_step = JobRecord.model_validate({**old, "metrics": OLD_UNTRAINED_ROW})
    assert with_step.metrics == StepMetrics(**OLD_UNTRAINED_ROW)


def test_the_rest_api_serves_and_documents_the_rows(redis_url: str, tmp_path: Path) -> None:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store))
    job_id = store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})).id
    assert client.get(f"/v1/jobs/{job_id}").json()["metrics"] is None
    store.claim(job_id, "c")
    progress = ProgressStore(store)
    for step, stats in ((1, None), (2, trainer_pb2.TrainStats(**OLD_TRAIN_STATS, **STALENESS_STATS,
                                                              **ROUTING_STATS, **SHARING_STATS, **KL_STATS))):
        row = _record(stats).model_copy(update={"step": step})
        state = JobProgress(step=step, version=step, prompt_epoch=0, prompt_cursor=step, group_counter=step,
                            scheduler={}, num_trained_samples=step)
        progress.commit_step(job_id, "c", progress=state, carried=[], closed_sample_ids=[], metrics=row,
                             record_changes={"step": step, "metrics": row})
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()
    assert rows == [{**OLD_UNTRAINED_ROW, **ADDED, "step": 1},
                    {**OLD_UNTRAINED_ROW, **ADDED, **OLD_TRAIN_STATS, **STALENESS_STATS, **ROUTING_STATS,
                     **SHARING_STATS, **KL_STATS, "step": 2}]
    assert client.get(f"/v1/jobs/{job_id}").json()["metrics"] == rows[-1]

    schema = client.get("/openapi.json").json()
    response = schema["paths"]["/v1/jobs/{job_id}/metrics"]["get"]["responses"]["200"]["content"]
    assert response["application/json"]["schema"]["items"]["$ref"].endswith("/StepMetrics")
    for name in ("StepMetrics", "Evaluation"):
        fields = schema["components"]["schemas"][name]["properties"]
        assert all(field.get("description") for field in fields.values()), f"every {name} field is described"
    assert set(schema["components"]["schemas"]["StepMetrics"]["properties"]) == {
        *OLD_UNTRAINED_ROW, *ADDED, *OLD_TRAIN_STATS, *STALENESS_STATS, *ROUTING_STATS, *SHARING_STATS, *KL_STATS,
        *TOOL_FIELDS, *REWARD_KL_FIELDS, "reward_metrics"}
