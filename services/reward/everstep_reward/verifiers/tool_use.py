"""A reward for how a multi-turn trajectory used its tools (`RewardItem.tool_trajectory`, docs/tools.md).

The score is the fraction of the trajectory's tool calls that were well formed: parseable, naming a tool the job
offers, with arguments that fit its parameters (the call may still have failed in the tool: a timeout, a program
that raised, an environment error, or max_tool_calls reached, are not the model's format). With fewer calls than
`min_calls` the score is 0 (a task the model should solve with its tools), and a trajectory with no calls and
`min_calls` 0 scores 1. Give it a small weight beside a correctness reward.
"""

from __future__ import annotations

from pydantic import Field

from everstep.v1 import common_pb2, reward_pb2
from everstep_reward.verifiers.base import Outcome, VerifierResult
from everstep_reward.verifiers.params import VerifierParams, read_params

__all__ = ["ToolUseParams", "ToolUseVerifier"]

_MODEL_ERRORS = frozenset({common_pb2.TOOL_ERROR_KIND_MALFORMED, common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL,
                           common_pb2.TOOL_ERROR_KIND_BAD_ARGUMENTS})


class ToolUseParams(VerifierParams):
    """The tool_use verifier's options (`VerifierSpec.params` per item)."""

    min_calls: int = Field(0, ge=0, description="Fewer tool calls than this score 0.")


class ToolUseVerifier:
    """Scores the well-formed fraction of a trajectory's tool calls; an item without a trajectory has no calls."""

    name = "tool_use"
    params_model = ToolUseParams

    def __init__(self, params: ToolUseParams | None = None) -> None:
        self._params = params or ToolUseParams()

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        params = read_params(spec, self._params)
        calls = list(item.tool_trajectory.calls)
        if len(calls) < params.min_calls:
            return VerifierResult(0.0, outcome=Outcome.INCORRECT)
        if not calls:
            return VerifierResult(1.0, outcome=Outcome.CORRECT)
        score = sum(c.error not in _MODEL_ERRORS for c in calls) / len(calls)
        outcome = Outcome.CORRECT if score == 1.0 else Outcome.INCORRECT if score == 0.0 else Outcome.PARTIAL
        return VerifierResult(score, outcome=outcome)
