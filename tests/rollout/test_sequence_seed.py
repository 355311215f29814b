"""A sequence's own seed (`Sequence.seed`, the controller's deterministic mode): one message carries
differently seeded sequences, and a seeded sequence samples the same tokens whatever the engine's
seed and whichever sequences decode beside it."""

from __future__ import annotations

from everstep.v1 import common_pb2
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.proto_convert import request_from_proto, sampling_from_proto

PROMPT = [1, 5, 12, 4, 13, 6]


def _outputs(model_dir, engine_seed: int, seeds: list[int], message_seed: int = 0) -> list[list[int]]:
    engine = Engine(model_dir, EngineConfig(max_running=8, seed=engine_seed))
    sampling = sampling_from_proto(common_pb2.SamplingParams(temperature=1.0, max_new_tokens=12, seed=message_seed))
    engine.add([request_from_proto(common_pb2.Sequence(id=f"s{i}", prompt_ids=PROMPT, seed=seed), sampling, 1)
                for i, seed in enumerate(seeds)])
    results = {}
    while engine.has_work:
        results.update({r.id: r.output_ids for r in engine.step()})
    return [results[f"s{i}"] for i in range(len(seeds))]


def test_a_sequence_seed_replaces_the_message_seed(tiny_model_dir) -> None:
    first = _outputs(tiny_model_dir, 1, [11, 11, 12, 13], message_seed=5)
    assert first[0] == first[1] and len({tuple(o) for o in first[1:]}) == 3, "same seed, same sample; others differ"
    # another engine seed, other neighbours in the batch: the seeded sample is the same
    assert _outputs(tiny_model_dir, 2, [13, 11])[1] == first[0]
    # without a seed of its own a sequence takes the message's
    assert _outputs(tiny_model_dir, 3, [0], message_seed=11)[0] == first[0]
