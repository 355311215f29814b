"""`everstep samples JOB [--step N]`: a step's trajectories as text (GET /v1/jobs/{id}/samples)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_samples"]


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines() or [""])


def _provenance(sample: dict[str, Any]) -> str:
    """group, advantage and policy version(s); a sample stored before they were recorded shows '?'."""
    advantage = sample.get("advantage")
    low, high = sample.get("version_min"), sample.get("version_max")
    versions = "?" if low is None else str(low) if low == high else f"{low}-{high}"
    return (f"   group {sample.get('group_id') or '?'}  advantage "
            f"{'not trained' if advantage is None else f'{advantage:+.3f}'}  policy version {versions}")


def format_samples(samples: list[dict[str, Any]]) -> str:
    """Each sample: its reward, group, advantage and policy versions, its prompt (the row's text, then as the model
    saw it, rendered with the chat template), its model and tool segments in order, its tool calls and its answer."""
    out = []
    for sample in samples:
        reward = "failed" if sample["reward"] is None else f"{sample['reward']:.3f}"
        out.append(f"== {sample['sample_id']}  reward {reward}  turns {sample['num_turns']}  "
                   f"tool calls {len(sample['tool_calls'])}  ({sample['finish_reason']})")
        out.append(_provenance(sample))
        out.append("prompt:")
        out.append(_indent(sample["prompt"]))
        if sample.get("rendered_prompt"):  # absent from samples kept by an older controller
            out.append("rendered prompt:")
            out.append(_indent(sample["rendered_prompt"]))
        for segment in sample["segments"]:
            out.append(f"{segment['role']}:")
            out.append(_indent(segment["text"]))
        for call in sample["tool_calls"]:
            error = "" if call["error"] == "none" else f"  error {call['error']}"
            cut = "  (reply truncated)" if call["truncated"] else ""
            out.append(f"call (turn {call['turn']}) {call['name'] or '?'}({call['arguments']})  "
                       f"{call['seconds']:.3f}s{error}{cut}")
        out.append("answer:")
        out.append(_indent(sample["final_answer"]))
        out.append("")
    return "\n".join(out) + ("\n" if out else "")
