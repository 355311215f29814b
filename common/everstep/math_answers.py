"""The final answer of a math response, as the math verifier reads it (`everstep_reward.verifiers.math`).

Shared so that the controller reads the same answers the verifier scored: evaluation's maj@k votes over them
(`everstep_controller.run.evaluation`), without importing the reward service.
"""

from __future__ import annotations

import re

__all__ = ["extract_boxed_answer", "extract_last_number", "final_math_answer"]

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}`, stripped; None if there is none."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:index].strip()
                    if content:
                        return content
                    break
    return None


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (an optional minus sign, digits, an optional decimal part); None if
    it has none."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def final_math_answer(text: str, *, last_number: bool = False) -> str | None:
    """The answer the math verifier compares: the last non-empty box, or with `last_number` (its `extract:
    last_number`) the last number when there is no box; None when there is neither."""
    answer = extract_boxed_answer(text)
    if answer is None and last_number:
        answer = extract_last_number(text)
    return answer
