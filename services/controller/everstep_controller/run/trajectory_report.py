"""What a step's trajectories did, for its metrics row and for `GET /v1/jobs/{id}/samples`: tool use in numbers
(`TrajectoryStats`) and a few samples rendered as people read them (`render_sample`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby

from everstep.rest.step_samples import SampleSegment, StepSample, ToolCallView
from everstep.tools.error_kind import tool_error_kind_name
from everstep.v1 import common_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.trajectories import final_answer

__all__ = ["TrajectoryStats", "render_sample"]


@dataclass(frozen=True)
class TrajectoryStats:
    """A step's tool use, over its trained samples (all zero for a job without tools)."""

    num_samples: int = 0
    has_tools: bool = False
    """Whether the samples are trajectories of a job with tools."""
    turns_per_sample: float = 0.0
    tool_use_rate: float = 0.0
    """Fraction of the samples with at least one tool call."""
    num_tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Calls by error kind (`everstep.tools.error_kind`), the ones that ran as asked left out."""
    tool_seconds_mean: float = 0.0

    @classmethod
    def of(cls, sequences: Sequence[common_pb2.Sequence]) -> TrajectoryStats:
        trajectories = [s.tool_trajectory for s in sequences if s.HasField("tool_trajectory")]
        if not trajectories:
            return cls(num_samples=len(sequences))
        calls = [c for t in trajectories for c in t.calls]
        errors = Counter(tool_error_kind_name(c.error) for c in calls if c.error)
        n = len(sequences)
        return cls(num_samples=n, has_tools=True, turns_per_sample=sum(t.num_turns for t in trajectories) / n,
                   tool_use_rate=sum(bool(t.calls) for t in trajectories) / n, num_tool_calls=len(calls),
                   tool_errors=dict(sorted(errors.items())),
                   tool_seconds_mean=sum(c.seconds for c in calls) / len(calls) if calls else 0.0)


def render_sample(sample_id: str, row: PromptRow, sequence: common_pb2.Sequence, reward: float | None,
                  decode: Callable[[list[int]], str], *, engine: str = "", group_id: str = "",
                  advantage: float | None = None, kl_penalty: float | None = None) -> StepSample:
    """A trajectory as people read it: the rendered prompt and its runs of model and tool tokens, each decoded with
    `decode` (control tokens kept, so that the prompt and the turns show as the model saw them), its group, advantage
    and the policy versions that sampled it; `kl_penalty`: what trainer.kl_in_reward took off its reward."""
    mask = list(sequence.output_tool_mask) or [False] * len(sequence.output_ids)
    segments, start = [], 0
    for is_tool, run in groupby(mask):
        length = len(list(run))
        ids = list(sequence.output_ids[start:start + length])
        segments.append(SampleSegment(role="tool" if is_tool else "model", text=decode(ids)))
        start += length
    trajectory = sequence.tool_trajectory
    calls = [ToolCallView(turn=c.turn, name=c.name, arguments=c.arguments_json, reply=c.reply,
                          error=tool_error_kind_name(c.error), seconds=c.seconds, truncated=c.truncated)
             for c in trajectory.calls]
    versions = [v for v, tool in zip(sequence.output_versions, mask, strict=False) if not tool]
    reason = common_pb2.FinishReason.Name(sequence.finish_reason).removeprefix("FINISH_REASON_").lower()
    return StepSample(sample_id=sample_id, prompt=row.prompt, rendered_prompt=decode(list(sequence.prompt_ids)),
                      segments=segments, final_answer=final_answer(sequence),
                      reward=reward, num_turns=trajectory.num_turns if sequence.HasField("tool_trajectory") else 1,
                      tool_calls=calls, finish_reason=reason, engine=engine, group_id=group_id, advantage=advantage,
                      kl_penalty=kl_penalty, version_min=min(versions, default=None),
                      version_max=max(versions, default=None))
