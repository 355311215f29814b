"""The torch engine's penalties count each sequence's own output, across its decode steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from test_routed_experts import run

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.sequence import GenerationRequest, SamplingOptions

PROMPT = [1, 7, 7, 7, 9]


def test_a_presence_penalty_changes_a_greedy_sequence_only_after_its_first_token(
        tiny_model_dirs: Callable[[str], Path]) -> None:
    """Greedy decoding with and without penalties: the same first token (nothing output yet), then a sequence with
    fewer repeats; the penalised sequence beside a plain one leaves the plain one as it is alone; log-probs stay the
    model's (those of the plain run where the two agree)."""
    model_dir = tiny_model_dirs("llama")

    def generate(**penalties: float) -> dict:
        engine = Engine(model_dir, EngineConfig(max_running=4, max_seq_len=64, seed=0))
        sampling = SamplingOptions(temperature=0.0, max_new_tokens=24, **penalties)
        plain = SamplingOptions(temperature=0.0, max_new_tokens=24)
        return run(engine, [GenerationRequest(id="x", prompt_ids=PROMPT, sampling=sampling),
                            GenerationRequest(id="plain", prompt_ids=PROMPT, sampling=plain)])

    plain = generate()["x"]
    penalized_results = generate(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)
    penalized = penalized_results["x"]
    assert penalized_results["plain"].output_ids == plain.output_ids
    assert penalized.output_ids[0] == plain.output_ids[0]
    assert abs(penalized.output_logprobs[0] - plain.output_logprobs[0]) < 1e-5
    assert len(set(plain.output_ids)) < len(plain.output_ids), "the tiny model should repeat itself greedily"
    assert len(set(penalized.output_ids)) > len(set(plain.output_ids))
