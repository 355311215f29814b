"""One `RewardItem` per response: the job's reward spec merged with the row's data (docs/reward.md,
"What a caller fills"). Training samples and evaluation samples are built here alike."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import struct_pb2

from everstep.rest.job_spec import RewardFunctionSpec, VerifierWeight
from everstep.reward_functions import FUNCTION_VERIFIER
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.trajectories import final_answer, num_model_tokens

__all__ = ["RewardItemBuilder"]

CODE = "code"  # the verifier that reads the row's tests, language and function name


class RewardItemBuilder:
    """Builds the reward item of a response to a row from the job's `reward.verifiers` and `reward.functions`.

    Every verifier of the job applies unless the row lists the ones that do (`PromptRow.verifiers`).
    Each spec gets its weight, the job's params for it and the row's answer (only `math` reads it);
    `code` also gets the row's tests and language (else the job's default language). Every function applies to
    every row: a spec named "function" with its source (filled at submission) and the row's answer as the ground
    truth.
    """

    def __init__(self, verifiers: Sequence[VerifierWeight], functions: Sequence[RewardFunctionSpec] = ()) -> None:
        missing = [f.path for f in functions if f.source is None]
        if missing:
            raise ValueError(f"reward functions without their source (read at submission): {missing}")
        self._functions = [reward_pb2.RewardFunction(name=f.name, source=f.source, path=f.path,
                                                      allow_network=f.allow_network) for f in functions]
        self._function_weights = [f.weight for f in functions]
        self._verifiers = list(verifiers)
        self._params: dict[str, struct_pb2.Struct] = {}
        for v in self._verifiers:  # built once: a job's params are the same for every item
            self._params[v.name] = struct_pb2.Struct()
            self._params[v.name].update(v.params)

    def __call__(self, item_id: str, row: PromptRow, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
        """sequence: the finished rollout (its text, decoded without control tokens, is the response; its output
        ids the token count). The prompt sent is the user's text (`PromptRow.prompt`), not the chat template's."""
        item = reward_pb2.RewardItem(id=item_id, response=final_answer(sequence), prompt=row.prompt,
                                     num_response_tokens=num_model_tokens(sequence))
        if sequence.HasField("tool_trajectory"):  # the verifiers see the answer and the whole trajectory
            item.trajectory = sequence.output_text
            item.tool_trajectory.CopyFrom(sequence.tool_trajectory)
        for v in self._verifiers:
            if row.verifiers and v.name not in row.verifiers:
                continue
            spec = item.verifiers.add(name=v.name, weight=v.weight, answer=row.answer)
            if v.params:
                spec.params.CopyFrom(self._params[v.name])
            if v.name == CODE:
                spec.language = row.language or v.language or ""
                spec.tests.extend(reward_pb2.CodeTest(stdin=t.stdin, expected_stdout=t.expected_stdout)
                                  for t in row.tests.stdio)
                spec.function_tests.extend(
                    reward_pb2.FunctionCallTest(arguments_json=t.arguments_json, expected_json=t.expected_json)
                    for t in row.tests.function_calls)
                spec.function_name = row.tests.function_name
        for function, weight in zip(self._functions, self._function_weights, strict=True):
            item.verifiers.add(name=FUNCTION_VERIFIER, weight=weight, answer=row.answer, function=function)
        return item
