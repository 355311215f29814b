"""Rewards the real reward service could not compute, through real scorers and Redis: a bad row's group
is left out of training and counted (the job goes on), a transient error is asked for again and then
fails the step with its cause, a bad option of the job's reward spec fails it naming the option."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import redis

from everstep.rest.job_record import DatasetReport
from everstep.rest.job_spec import JobSpec, RewardSpec
from everstep.settings.training import SchedulerMode
from everstep.v1 import common_pb2
from everstep_controller.algo.scheduler import C3POScheduler, SchedulerConfig
from everstep_controller.algo.training_batch import build_batch
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_errors import ErrorClass, RewardFailed
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.data.row_tests import RowTests, StdioCase
from everstep_controller.run import metrics
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.evaluation import scored_results
from everstep_controller.run.scoring import ScorerPool, ScoringDepth
from everstep_controller.run.unscorable_rows import UnscorableRows
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import ProgressStore, ScoredSample

JOB = "job1"
MATH_ROW = PromptRow(index=0, prompt="3 + 4 =", answer="7", prompt_ids=(1,))
CODE_TESTS = RowTests(stdio=(StdioCase("", "7\n"),))
CODE_ROW_WITHOUT_LANGUAGE = PromptRow(index=1, prompt="print 7", answer="", prompt_ids=(1,), tests=CODE_TESTS)
CODE_ROW = PromptRow(index=2, prompt="print 7", answer="", prompt_ids=(1,), tests=CODE_TESTS, language="python")


@pytest.fixture
def progress(redis_url: str) -> ProgressStore:
    store = JobStore(redis.Redis.from_url(redis_url))
    store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}))
    return ProgressStore(store)


def _verifiers(*entries: dict) -> list:
    return RewardSpec.model_validate({"verifiers": list(entries)}).verifiers


def _score(progress: ProgressStore, reward_address: str, verifiers: list, rows: dict[str, PromptRow], *,
           score_attempts: int = 3) -> tuple[dict[str, ScoredSample], ScorerPool]:
    """Scores one response per sample id (row by id) with real scorers; returns the stored scores."""
    by_index = {row.index: row for row in rows.values()}
    build = RewardItemBuilder(verifiers)
    pool = ScorerPool(JOB, progress, RewardClient(reward_address, timeout_seconds=30),
                      lambda sample_id, index, sequence: build(sample_id, by_index[index], sequence),
                      num_workers=1, score_attempts=score_attempts)
    for sample_id, row in rows.items():
        response = "\\boxed{7}" if sample_id.endswith("0") else "\\boxed{5}"
        pool.submit(sample_id, row.index, common_pb2.Sequence(id=sample_id, prompt_ids=[1], output_ids=[2, 3],
                                                              output_text=response))
    pool.start()
    try:
        pool.wait_scored(list(rows), timeout_seconds=60)
    finally:
        pool.stop()
    return progress.scored(JOB, list(rows)), pool


def _scheduler(groups: dict[str, list[str]]) -> C3POScheduler:
    scheduler = C3POScheduler(SchedulerConfig(mode=SchedulerMode.c3po, group_size=2, token_budget=10_000, retention=0,
                                              pool_capacity=8, prompts_per_iteration=1))
    for index, (group_id, sample_ids) in enumerate(groups.items()):
        scheduler.start_group(group_id, index, sample_ids)
        for sample_id in sample_ids:
            scheduler.on_finished(sample_id, 2)
    assert scheduler.end_iteration({}).trainable_groups == list(groups)
    return scheduler


def test_a_bad_rows_group_is_left_out_and_counted_while_the_others_train(
        progress: ProgressStore, reward_address: str, caplog: pytest.LogCaptureFixture) -> None:
    verifiers = _verifiers({"name": "math"}, {"name": "code"})  # no default language for code rows
    math_row = replace(MATH_ROW, verifiers=("math",))  # as a mixed dataset's rows say which verifier applies
    code_row = replace(CODE_ROW_WITHOUT_LANGUAGE, verifiers=("code",))
    scored, _ = _score(progress, reward_address, verifiers, {"m0": math_row, "m1": math_row, "c0": code_row,
                                                             "c1": code_row})
    assert scored["c0"].error_class == ErrorClass.ROW and "language" in scored["c0"].error
    assert [(e.verifier, e.label) for e in scored["c0"].part_errors] == [("code", "invalid_spec")]

    scheduler = _scheduler({"gm": ["m0", "m1"], "gc": ["c0", "c1"]})
    batch = build_batch(["gm", "gc"], scheduler, scored, drop_zero_signal=True, normalize_std=True)
    assert [s.reward for s in batch.samples] == [1.0, 0.0], "the math group trains"
    assert list(batch.unscorable) == ["gc"] and set(batch.unscorable["gc"]) == {"c0", "c1"}

    counted = metrics.UNSCORABLE_SAMPLES.labels(kind="invalid_spec")
    before = counted._value.get()
    report = UnscorableRows(JOB, DatasetReport(num_rows=3, num_skipped=0))
    with caplog.at_level(logging.WARNING, logger="everstep_controller.run.unscorable_rows"):
        assert report.note(batch.unscorable, {"gc": 1})
        assert not report.note(batch.unscorable, {"gc": 1}), "a row already listed changes nothing"
    assert counted._value.get() - before == 4, "every sample is counted, each time its row comes back"
    assert len([r for r in caplog.records if "dataset row 1 cannot be scored" in r.getMessage()]) == 1
    (entry,) = report.report.unscorable
    assert (entry["row"], entry["verifier"], entry["kind"]) == (1, "code", "invalid_spec")
    assert "language" in entry["reason"]


def test_a_transient_error_is_asked_for_again_then_fails_the_step_with_its_cause(
        progress: ProgressStore, reward_address: str) -> None:
    retries = metrics.REWARD_RETRIES.labels(kind="sandbox_unavailable")
    before = retries._value.get()
    # a valid code row, but this reward service has no sandbox: sandbox_unavailable every time
    scored, pool = _score(progress, reward_address, _verifiers({"name": "code"}), {"c0": CODE_ROW, "c1": CODE_ROW},
                          score_attempts=2)
    assert retries._value.get() - before == 2, "each sample was asked for once more"
    assert "TransientRewardErrors" in (pool.last_error or "")
    assert scored["c0"].error_class == ErrorClass.TRANSIENT
    assert pool.depth() == ScoringDepth(queued=0, in_flight=0), "released once the error was stored"
    with pytest.raises(RewardFailed, match=r"sample c0 failed: code: no sandbox configured.*sandbox_unavailable"):
        build_batch(["g"], _scheduler({"g": ["c0", "c1"]}), scored, drop_zero_signal=True, normalize_std=True)


def test_an_option_the_verifier_does_not_know_fails_the_step_naming_it(
        progress: ProgressStore, reward_address: str) -> None:
    verifiers = _verifiers({"name": "math"}, {"name": "length", "params": {"max_tokens": 100}})
    scored, _ = _score(progress, reward_address, verifiers, {"m0": MATH_ROW, "m1": MATH_ROW})
    assert scored["m0"].error_class == ErrorClass.JOB_SPEC
    with pytest.raises(RewardFailed, match=r"reward spec is wrong \(fix reward.verifiers or reward.functions\)"
                                           r".*length: params.max_tokens: unknown option"):
        build_batch(["g"], _scheduler({"g": ["m0", "m1"]}), scored, drop_zero_signal=True, normalize_std=True)


def test_evaluation_leaves_out_unscored_samples_and_fails_on_a_bad_reward_spec(reward_address: str) -> None:
    client = RewardClient(reward_address, timeout_seconds=30)
    rows = {"eval-s0-0": replace(MATH_ROW, verifiers=("math",)), "eval-s1-0": CODE_ROW_WITHOUT_LANGUAGE}
    sequence = common_pb2.Sequence(output_ids=[1], output_text="\\boxed{7}")
    try:
        build = RewardItemBuilder(_verifiers({"name": "math"}, {"name": "code"}))
        results = client.score([build(item_id, row, sequence) for item_id, row in rows.items()])
        assert list(scored_results(results, rows)) == ["eval-s0-0"], "the code row's sample is not counted as wrong"
        build = RewardItemBuilder(_verifiers({"name": "math", "params": {"strict": True}}))
        results = client.score([build(item_id, row, sequence) for item_id, row in rows.items()])
    finally:
        client.close()
    with pytest.raises(RewardFailed, match="params.strict: unknown option"):
        scored_results(results, rows)
