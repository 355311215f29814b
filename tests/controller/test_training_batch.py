"""The batch a step sends to the trainer: advantages over a group's surviving members only."""

from __future__ import annotations

import pytest

from everstep.rest.job_spec import JobSpec
from everstep.settings.training import SchedulerMode
from everstep.v1 import common_pb2, trainer_pb2
from everstep_controller.algo.reward_kl import MeasureKl
from everstep_controller.algo.scheduler import C3POScheduler, SchedulerConfig
from everstep_controller.algo.training_batch import build_batch, sampled_token_staleness, trainer_config
from everstep_controller.data.reward_errors import RewardFailed
from everstep_controller.store.progress_store import ScoredSample


def _scored(reward: float, error: str = "", finish_reason: int = common_pb2.FINISH_REASON_STOP) -> ScoredSample:
    sequence = common_pb2.Sequence(prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-0.5, -0.25],
                                   output_versions=[0, 1], finish_reason=finish_reason)
    return ScoredSample(sequence=sequence.SerializeToString(), reward=reward, error=error)


@pytest.fixture
def scheduler() -> C3POScheduler:
    """g0: three finished, one purged; g1: all finished with equal rewards."""
    scheduler = C3POScheduler(SchedulerConfig(mode=SchedulerMode.c3po, group_size=4, token_budget=10_000, retention=0,
                                              pool_capacity=8, prompts_per_iteration=1))
    scheduler.start_group("g0", 0, ["a", "b", "c", "d"])
    scheduler.start_group("g1", 1, ["e", "f", "g", "h"])
    for sample_id in "abcefgh":
        scheduler.on_finished(sample_id, 2)
    outcome = scheduler.end_iteration({"d": 1})
    assert outcome.purged_samples == ["d"] and outcome.trainable_groups == ["g0", "g1"]
    return scheduler


def test_purged_members_are_left_out_and_zero_signal_groups_dropped(scheduler: C3POScheduler) -> None:
    scored = {"a": _scored(1.0), "b": _scored(0.0), "c": _scored(0.0)} | {s: _scored(1.0) for s in "efgh"}
    step_batch = build_batch(["g0", "g1"], scheduler, scored, drop_zero_signal=True, normalize_std=False)
    batch = step_batch.samples
    assert step_batch.num_zero_signal == 1 and len(batch) == 3 and not step_batch.unscorable
    assert [s.advantage for s in batch] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert list(batch[0].output_versions) == [0, 1] and list(batch[0].rollout_logprobs) == [-0.5, -0.25]
    step_batch = build_batch(["g0", "g1"], scheduler, scored, drop_zero_signal=False, normalize_std=True)
    assert step_batch.num_zero_signal == 0 and len(step_batch.samples) == 7


def test_truncated_members_count_in_the_advantages_but_are_not_trained_on(scheduler: C3POScheduler) -> None:
    """algorithm.mask_truncated_completions: a member cut at max_new_tokens keeps its place in the group's
    baseline (the others' advantages are those of the whole group) and is left out of the batch."""
    scored = {"a": _scored(1.0), "b": _scored(0.0, finish_reason=common_pb2.FINISH_REASON_LENGTH), "c": _scored(0.0)}
    whole = build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=False)
    masked = build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=False, mask_truncated=True)
    assert len(whole.samples) == 3 and whole.num_truncated_masked == 0
    assert masked.num_truncated_masked == 1 and list(masked.trained_advantages) == ["a", "c"]
    assert masked.trained_advantages["a"] == pytest.approx(whole.trained_advantages["a"])
    assert [s.advantage for s in masked.samples] == pytest.approx([whole.samples[0].advantage,
                                                                  whole.samples[2].advantage])


def test_a_failed_score_fails_the_step(scheduler: C3POScheduler) -> None:
    scored = {"a": _scored(1.0), "b": _scored(0.0, error="timeout"), "c": _scored(0.0)}
    with pytest.raises(RewardFailed, match="sample b failed: timeout"):
        build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=True)


def test_a_restarted_trainer_gets_the_schedule_of_the_remaining_steps() -> None:
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, steps=100, trainer={"warmup_steps": 10})
    assert (trainer_config(spec).warmup_steps, trainer_config(spec).total_steps) == (10, 100)
    assert (trainer_config(spec, 4).warmup_steps, trainer_config(spec, 4).total_steps) == (6, 96)
    assert (trainer_config(spec, 40).warmup_steps, trainer_config(spec, 40).total_steps) == (0, 60)


def test_routed_experts_reach_the_trainer_as_the_engine_recorded_them(scheduler: C3POScheduler) -> None:
    """Routing replay: each sample's routes (uint8 [position][moe layer][k]) cross the Redis score hash and reach its
    TrainSample byte for byte; the trainer's config says replay is on."""
    routes = {sample_id: bytes([i, (i + 3) % 8, 7, 1] * 2) for i, sample_id in enumerate("abc")}  # 2 positions

    def scored(sample_id: str, reward: float) -> ScoredSample:
        sequence = common_pb2.Sequence(prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-0.5, -0.25],
                                       output_versions=[0, 1], routed_experts=routes[sample_id])
        stored = ScoredSample(sequence=sequence.SerializeToString(), reward=reward).model_dump_json()
        return ScoredSample.model_validate_json(stored)  # as the scorer stores it in Redis and reads it back

    batch = build_batch(["g0"], scheduler, {"a": scored("a", 1.0), "b": scored("b", 0.0), "c": scored("c", 0.0)},
                        drop_zero_signal=True, normalize_std=False).samples
    assert [s.routed_experts for s in batch] == [routes["a"], routes["b"], routes["c"]]
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, algorithm={"routing_replay": "rollout"})
    assert trainer_config(spec).routing_replay == trainer_config(spec).DESCRIPTOR.fields_by_name[
        "routing_replay"].enum_type.values_by_name["ROUTING_REPLAY_ROLLOUT"].number


def test_the_named_estimator_sees_every_kept_group_at_once(scheduler: C3POScheduler) -> None:
    """REINFORCE++ whitens over the whole batch: the all-equal group g1, kept, gets a nonzero advantage."""
    scored = {"a": _scored(1.0), "b": _scored(0.0), "c": _scored(0.0)} | {s: _scored(1.0) for s in "efgh"}
    batch = build_batch(["g0", "g1"], scheduler, scored, drop_zero_signal=False, normalize_std=False,
                        advantage="reinforce_plus_plus").samples
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    mean, std = sum(rewards) / 7, (sum((r - sum(rewards) / 7) ** 2 for r in rewards) / 7) ** 0.5
    assert [s.advantage for s in batch] == pytest.approx([(r - mean) / std for r in rewards], abs=1e-5)
    rloo = build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=False, advantage="rloo")
    assert [s.advantage for s in rloo.samples] == pytest.approx([1.0, -0.5, -0.5])


def test_the_trainer_gets_the_loss_mode_schedule_and_max_new_tokens() -> None:
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, sampling={"max_new_tokens": 64},
                   algorithm={"loss": {"mode": "gspo", "clip_ratio_c": 3.0}}, trainer={"lr_schedule": "linear"})
    config = trainer_config(spec)
    assert config.max_new_tokens == 64 and config.clip_ratio_c == 3.0
    assert config.mode == config.DESCRIPTOR.fields_by_name["mode"].enum_type.values_by_name["LOSS_MODE_GSPO"].number


def test_staleness_counts_only_the_tokens_the_model_sampled() -> None:
    """A tool's reply (tool-masked, version -1) is not stale: a sync step at version 5 whose model tokens are all
    version 5 has staleness 0, where counting the reply gave 5 - (-1) = 6."""
    multi_turn = trainer_pb2.TrainSample(output_ids=[1, 2, 3, 4, 5], output_versions=[5, -1, -1, 5, 5],
                                         output_tool_mask=[False, True, True, False, False])
    assert sampled_token_staleness([multi_turn], 5) == [0, 0, 0]
    carried = trainer_pb2.TrainSample(output_ids=[1, 2, 3, 4], output_versions=[3, -1, 4, 5],
                                      output_tool_mask=[False, True, False, False])
    single_turn = trainer_pb2.TrainSample(output_ids=[1, 2], output_versions=[4, 5])
    unknown = trainer_pb2.TrainSample(output_ids=[1, 2], output_versions=[])
    assert sampled_token_staleness([carried, single_turn, unknown], 5) == [2, 1, 0, 1, 0]
    # a model token of unknown version (-1, an engine that records none) has no age either
    assert sampled_token_staleness([trainer_pb2.TrainSample(output_ids=[1], output_versions=[-1])], 5) == []


def _kl_sums(sums: dict[str, float], coef: float, asked: list[list[int]]) -> MeasureKl:
    """A ReferenceKl reply with the given sums, in the order the samples were asked (the arithmetic of the batch is
    tested here; the trainer's own call in tests/trainer/test_reward_side_kl.py and tests/e2e/test_kl_reward_job.py)."""
    def measure(samples: list[trainer_pb2.TrainSample]) -> trainer_pb2.ReferenceKlResponse:
        asked.append([len(s.output_ids) for s in samples])
        values = list(sums.values())[:len(samples)]
        return trainer_pb2.ReferenceKlResponse(kl_sums=values, kl_coef=coef, kl_mean=sum(values) / 6)
    return measure


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_the_kl_in_the_reward_is_subtracted_before_the_advantages(scheduler: C3POScheduler, advantage: str) -> None:
    """trainer.kl_in_reward: each kept member's reward is score - coef * sum_t kl_t, and the estimator sees that;
    the zero-signal group is dropped on its scores and never measured."""
    scored = {"a": _scored(1.0), "b": _scored(0.0), "c": _scored(0.0)} | {s: _scored(1.0) for s in "efgh"}
    sums, coef, asked = {"a": 2.0, "b": 0.5, "c": 1.0}, 0.25, []
    batch = build_batch(["g0", "g1"], scheduler, scored, drop_zero_signal=True, normalize_std=False,
                        advantage=advantage, measure_kl=_kl_sums(sums, coef, asked))
    assert len(asked) == 1 and len(asked[0]) == 3, "the kept group's three members, measured once"
    rewards = [scored[s].reward - coef * sums[s] for s in "abc"]  # 0.5, -0.125, -0.25
    if advantage == "grpo":
        expected = [r - sum(rewards) / 3 for r in rewards]
    else:
        expected = [r - (sum(rewards) - r) / 2 for r in rewards]
    assert [batch.trained_advantages[s] for s in "abc"] == pytest.approx(expected, rel=1e-9)
    assert batch.reward_kl is not None and batch.reward_kl.kl_coef == coef
    assert batch.reward_kl.penalties == pytest.approx({s: coef * sums[s] for s in "abc"})
    assert batch.reward_kl.penalty_mean == pytest.approx((0.5 + 0.125 + 0.25) / 3)
    assert [s.reward for s in batch.samples] == [1.0, 0.0, 0.0], "the samples carry their scores"
    plain = build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=False, advantage=advantage)
    assert [plain.trained_advantages[s] for s in "abc"] != pytest.approx(expected, rel=1e-3)


def test_a_batch_with_no_group_kept_asks_the_trainer_for_no_kl(scheduler: C3POScheduler) -> None:
    asked: list[list[int]] = []
    scored = {s: _scored(1.0) for s in "efgh"}
    batch = build_batch(["g1"], scheduler, scored, drop_zero_signal=True, normalize_std=False,
                        measure_kl=_kl_sums({}, 0.1, asked))
    assert not batch.samples and batch.reward_kl is None and asked == []


def test_a_trainer_answer_of_the_wrong_length_fails_the_step(scheduler: C3POScheduler) -> None:
    scored = {"a": _scored(1.0), "b": _scored(0.0), "c": _scored(0.0)}
    with pytest.raises(RuntimeError, match="2 KL sums for 3 samples"):
        build_batch(["g0"], scheduler, scored, drop_zero_signal=True, normalize_std=False,
                    measure_kl=_kl_sums({"a": 1.0, "b": 1.0}, 0.1, []))
