"""Rollouts with tools (multi-turn trajectories) as the controller sends and reads them: the row an http
environment's reset gets, the tokens the model wrote, and what the verifiers see (docs/tools.md)."""

from __future__ import annotations

import json

from everstep.v1 import common_pb2
from everstep_controller.data.dataset import PromptRow

__all__ = ["env_row", "final_answer", "new_sequence", "num_model_tokens"]


def env_row(row: PromptRow) -> dict[str, object]:
    """What an http environment's /reset receives as the row."""
    return {"index": row.index, "prompt": row.prompt, "answer": row.answer}


def new_sequence(sample_id: str, row: PromptRow, tools: bool) -> common_pb2.Sequence:
    """A new rollout of `row`; with tools, its trajectory starts with the row for the environment."""
    sequence = common_pb2.Sequence(id=sample_id, prompt_ids=row.prompt_ids)
    if tools:
        sequence.tool_trajectory.row_json = json.dumps(env_row(row), ensure_ascii=False)
    return sequence


def num_model_tokens(sequence: common_pb2.Sequence) -> int:
    """Output tokens the model generated (a tool's reply tokens left out): what C3PO++'s budget counts."""
    return len(sequence.output_ids) - sum(sequence.output_tool_mask)


def final_answer(sequence: common_pb2.Sequence) -> str:
    """The model's answer: its last turn's text with tools, else its whole output."""
    if sequence.HasField("tool_trajectory"):
        return sequence.tool_trajectory.final_text
    return sequence.output_text

