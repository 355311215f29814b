"""The `model` verifier: a tiny random reward model, scored in batches; torch stays optional."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.base import Outcome
from everstep_reward.verifiers.model import ModelVerifier, RewardModel, RewardModelSettings

SPEC = reward_pb2.VerifierSpec(name="model", weight=1.0)
RESPONSES = ["so the answer is \\boxed{ 3 }", "bad", "good good good so 7", "<think> 1 2 3 </think> \\boxed{ 6 }",
             "the answer is 12", "19 18 17 16 15 14 13 12 11 10"]


def item(response: str, prompt: str = "") -> reward_pb2.RewardItem:
    return reward_pb2.RewardItem(id="a", response=response, prompt=prompt)


def reference_scores(model_dir: Path, texts: list[str]) -> list[float]:
    """Each text alone through transformers directly: no padding involved."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return [float(model(**tokenizer(text, return_tensors="pt")).logits[0, 0]) for text in texts]


def test_batched_scores_equal_one_at_a_time_scores(reward_model_dir: Path) -> None:
    model = RewardModel.load(RewardModelSettings(path=str(reward_model_dir), num_threads=1))
    verifier = ModelVerifier(model, timeout_seconds=30, batch_size=4, batch_wait_seconds=0.05)
    try:
        with ThreadPoolExecutor(len(RESPONSES)) as threads:  # concurrent items share padded batches
            results = list(threads.map(lambda text: verifier.score(item(text), SPEC), RESPONSES))
    finally:
        verifier.close()
    assert all(r.ok and r.metric_outcome() == Outcome.SCORED for r in results)
    expected = reference_scores(reward_model_dir, RESPONSES)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 4) for s in expected}) == len(expected)  # a random model still tells texts apart


def test_long_responses_are_truncated_from_the_left(reward_model_dir: Path) -> None:
    model = RewardModel.load(RewardModelSettings(path=str(reward_model_dir), max_tokens=4, num_threads=1))
    tail = "so the answer is"
    assert model.score(["1 2 3 4 5 6 7 8 " + tail])[0] == pytest.approx(model.score([tail])[0], abs=1e-5)


def test_the_model_reads_the_prompt_before_the_response(reward_model_dir: Path) -> None:
    model = RewardModel.load(RewardModelSettings(path=str(reward_model_dir), num_threads=1))
    verifier = ModelVerifier(model, timeout_seconds=30, batch_size=2)
    prompt, response = "1 + 2 is", "so the answer is \\boxed{ 3 }"
    try:
        with_prompt = verifier.score(item(response, prompt), SPEC).score
        alone = verifier.score(item(response), SPEC).score
    finally:
        verifier.close()
    # The tiny model's tokenizer has no chat template: the prompt goes first, on its own line.
    expected_with, expected_alone = reference_scores(reward_model_dir, [f"{prompt}\n{response}", response])
    assert with_prompt == pytest.approx(expected_with, abs=1e-4) and alone == pytest.approx(expected_alone, abs=1e-4)
    assert with_prompt != pytest.approx(alone, abs=1e-4)


def test_without_a_model_the_verifier_reports_an_error() -> None:
    result = ModelVerifier(None, timeout_seconds=1).score(item("x"), SPEC)
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_MODEL_UNAVAILABLE and "--reward-model" in result.error


def test_the_service_imports_no_torch_without_a_reward_model() -> None:
    code = ("import sys, everstep_reward.server, everstep_reward.__main__, everstep_reward.verifiers.model; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_classifier_with_several_labels_is_refused(tmp_path: Path, reward_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(reward_model_dir, num_labels=3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(reward_model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardModel.load(RewardModelSettings(path=str(tmp_path)))
