"""Evaluation's pass@k and maj@k against hand-computed values, and evaluate() end to end on stand-in engines and
reward (what each sample answers is fixed by its id)."""

from __future__ import annotations

from collections.abc import Iterator
from math import comb

import pytest

from everstep.rest.job_spec import EvaluationSpec, JobSpec, RewardSpec, VerifierWeight
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.run.evaluation import evaluate, majority_correct, math_answer_reader, pass_at_k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (6, 2, 3, 1 - 4 / 20),  # 1 - C(4,3)/C(6,3)
    (10, 3, 1, 0.3),  # pass@1 is the share correct
    (4, 0, 4, 0.0),
    (4, 1, 4, 1.0),  # n = k: any correct sample passes
    (3, 3, 2, 1.0),
])
def test_pass_at_k_is_chen_et_al_s_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_refuses_k_beyond_the_samples() -> None:
    with pytest.raises(ValueError, match="k = 5, n = 4"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize(("answers", "scores", "expected"), [
    (["7", "8", " 7 ", None], [1.0, 0.0, 1.0, 0.0], 1.0),  # "7" twice (whitespace ignored)
    (["8", "8", "7", "7"], [0.0, 0.0, 1.0, 1.0], 0.0),  # a tie: the answer given first
    (["8", None, None, "7", "7"], [0.0, 0.0, 0.0, 1.0, 1.0], 1.0),  # no answer: no vote
    ([None, None], [0.0, 0.0], 0.0),
    (["\\frac{1}{2}", "\\frac{1} {2}", "0.5"], [1.0, 1.0, 1.0], 1.0),
])
def test_maj_at_k_takes_the_most_frequent_answer(answers, scores, expected) -> None:
    assert majority_correct(answers, scores) == expected


class StandInStream:
    """Stand-in for `PoolStream`: each sample's output text is ANSWERS[its id] (a greedy one answers 7)."""

    tools = None

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.sent: list[tuple[list[str], common_pb2.SamplingParams]] = []

    def send_groups(self, groups: list[list[common_pb2.Sequence]], sampling: common_pb2.SamplingParams) -> list[str]:
        """One engine: every group in one request, as `PoolStream.send_groups` sends each engine its groups."""
        self.sent.append(([s.id for group in groups for s in group], sampling))
        return ["engine"] * len(groups)

    def close(self) -> None:
        pass

    def cancel(self) -> None:
        raise AssertionError("not cancelled")

    def results(self) -> Iterator[tuple[str, common_pb2.Sequence]]:
        for ids, _ in self.sent:
            for i in ids:
                yield "engine", common_pb2.Sequence(id=i, output_ids=[1], output_text=self.answers.get(i, "\\boxed{7}"))


class StandInReward:
    """Stand-in for `RewardClient`: math scores 1 for the answer 7; an item whose response says FAIL is unscored."""

    def score(self, items: list[reward_pb2.RewardItem]) -> dict[str, reward_pb2.ScoreResult]:
        results = {}
        for item in items:
            if "FAIL" in item.response:
                part = reward_pb2.RewardPart(verifier="math", error="timeout",
                                             error_kind=reward_pb2.REWARD_ERROR_KIND_TIMEOUT)
                results[item.id] = reward_pb2.ScoreResult(id=item.id, parts=[part], error="timeout")
                continue
            score = 1.0 if "\\boxed{7}" in item.response or item.response == "CODE" else 0.0
            verifier = "code" if item.response.startswith("CODE") else "math"
            results[item.id] = reward_pb2.ScoreResult(id=item.id, reward=score, parts=[
                reward_pb2.RewardPart(verifier=verifier, score=score, weight=1.0)])
        return results


def test_evaluate_reports_avg_pass_and_maj_at_k_and_samples_with_evaluation_sampling() -> None:
    rows = [PromptRow(index=i, prompt="3 + 4 =", answer="7", prompt_ids=(1,)) for i in range(4)]
    answers = {
        # row 0: one right of four, the majority wrong -> pass 1, maj 0
        "eval-s0-0": "\\boxed{7}", "eval-s0-1": "\\boxed{8}", "eval-s0-2": "\\boxed{8}", "eval-s0-3": "\\boxed{9}",
        # row 1: two right by the stand-in, three answers 7 -> pass 1, maj 1
        "eval-s1-0": "\\boxed{7}", "eval-s1-1": "\\boxed{ 7 }", "eval-s1-2": "no box", "eval-s1-3": "\\boxed{7}",
        # row 2: none right -> pass 0, maj 0
        "eval-s2-0": "\\boxed{1}", "eval-s2-1": "\\boxed{2}", "eval-s2-2": "\\boxed{2}", "eval-s2-3": "none",
        # row 3: an unscored sample -> left out of pass@k and maj@k, its others count in avg@k
        "eval-s3-0": "\\boxed{7}", "eval-s3-1": "FAIL", "eval-s3-2": "\\boxed{7}", "eval-s3-3": "\\boxed{7}",
    }
    stream = StandInStream(answers)
    spec = EvaluationSpec(samples_per_prompt=4)
    sampling = common_pb2.SamplingParams(temperature=0.6, top_p=0.95, max_new_tokens=64)
    greedy = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=64)

    def make_item(item_id: str, row: PromptRow, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
        return reward_pb2.RewardItem(id=item_id, response=sequence.output_text)

    evaluation = evaluate(stream, StandInReward(), rows, spec, sampling=sampling, greedy_sampling=greedy,
                          make_item=make_item, step=3,
                          answer_of=math_answer_reader(RewardSpec(verifiers=[VerifierWeight(name="math")])))
    assert evaluation.accuracy == pytest.approx((1 + 2 + 0 + 3) / 15)
    assert evaluation.pass_at_k == pytest.approx(2 / 3) and evaluation.maj_at_k == pytest.approx(1 / 3)
    assert evaluation.greedy_accuracy == 1.0 and evaluation.num_unscored == 1 and evaluation.k == 4
    # one engine: the 4 rows' samples in one request at the evaluation's temperature, the greedy answers in another
    assert [(len(ids), round(s.temperature, 4)) for ids, s in stream.sent] == [(16, 0.6), (4, 0.0)]
    assert math_answer_reader(RewardSpec(verifiers=[VerifierWeight(name="code")])) is None


def test_evaluation_samples_at_its_own_temperature_top_p_and_length_else_as_training() -> None:
    from everstep_controller.run.evaluation import evaluation_sampling

    base = {"model_path": "/m", "dataset": {"train_path": "/t.jsonl", "eval_path": "/e.jsonl"},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 20, "max_new_tokens": 256, "min_p": 0.05}}
    spec = JobSpec.model_validate(base)
    assert evaluation_sampling(spec) == spec.sampling and spec.max_answer_tokens == 256
    spec = JobSpec.model_validate(base | {"evaluation": {"sampling": {"temperature": 0.6, "top_p": 0.95,
                                                                      "max_new_tokens": 1024}}})
    sampling = evaluation_sampling(spec)
    assert (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (0.6, 0.95, 1024)
    assert (sampling.top_k, sampling.min_p) == (20, 0.05)  # the rest: training's
    assert spec.max_answer_tokens == 1024  # the engines are sized for evaluation's longer answers
    with pytest.raises(ValueError, match="evaluation.sampling.temperature"):
        JobSpec.model_validate(base | {"evaluation": {"sampling": {"temperature": 0}}})


def test_maj_at_k_counts_the_rows_the_math_verifier_scored() -> None:
    """A mixed job: a code row's samples have no final answer to vote on; it counts in pass@k, not in maj@k."""
    rows = [PromptRow(index=i, prompt="q", answer="7", prompt_ids=(1,)) for i in range(2)]
    answers = {"eval-s0-0": "\\boxed{7}", "eval-s0-1": "\\boxed{7}", "eval-s1-0": "CODE", "eval-s1-1": "CODE?"}

    def make_item(item_id: str, row: PromptRow, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
        return reward_pb2.RewardItem(id=item_id, response=sequence.output_text)

    spec = EvaluationSpec(samples_per_prompt=2, greedy=False)
    evaluation = evaluate(StandInStream(answers), StandInReward(), rows, spec,
                          sampling=common_pb2.SamplingParams(temperature=1.0),
                          greedy_sampling=common_pb2.SamplingParams(), make_item=make_item, step=0,
                          answer_of=math_answer_reader(RewardSpec(verifiers=[VerifierWeight(name="math"),
                                                                             VerifierWeight(name="code")])))
    assert evaluation.pass_at_k == 1.0 and evaluation.accuracy == 0.75
    assert evaluation.maj_at_k == 1.0, "the code row does not vote (its samples have no boxed answer)"
