"""Metrics rows for tests that commit steps without running one."""

from __future__ import annotations

from everstep.rest.step_metrics import (
    REWARD_FUNCTION_FIELDS,
    REWARD_KL_FIELDS,
    TOOL_FIELDS,
    TRAIN_STAT_FIELDS,
    Evaluation,
    StepMetrics,
)

_OPTIONAL = (*TRAIN_STAT_FIELDS, *TOOL_FIELDS, *REWARD_FUNCTION_FIELDS, *REWARD_KL_FIELDS)
_COUNTS = dict.fromkeys((name for name in StepMetrics.model_fields if name not in _OPTIONAL), 0)


def step_row(step: int) -> StepMetrics:
    """The row of a step that trained nothing: `step`, every count and time 0."""
    return StepMetrics(**{**_COUNTS, "step": step})


def eval_row(step: int) -> Evaluation:
    """An evaluation at `step` of one prompt, k=1."""
    return Evaluation(step=step, accuracy=0.5, greedy_accuracy=None, k=1, num_prompts=1, num_unscored=0)
