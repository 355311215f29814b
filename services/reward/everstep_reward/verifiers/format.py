"""The format rules: required tags, a final answer present, no degenerate repetition.

A response passes (1.0) when
- its think block is well formed: `<think>` and `</think>` each at most once, closed after being
  opened; with `require_think` the block must be there (and be closed);
- each of `required_tags` (e.g. `answer`) appears exactly once as `<tag>...</tag>`, closed after
  being opened, with something other than whitespace inside;
- with `require_boxed` (the default), the answer part (after `</think>`, or all of it without a
  think block) holds a non-empty `\\boxed{}` (the same extraction the math verifier uses);
- it does not loop: no stretch of words repeated back to back `repetition_min_repeats` times or
  more, covering at least `repetition_min_words` words (a model that degenerates repeats a phrase
  until it hits the length limit).
Else it scores 0.0, and the first rule broken is counted in everstep_reward_format_violations_total.
"""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import Field, field_validator

from everstep.math_answers import extract_boxed_answer
from everstep.v1 import reward_pb2
from everstep_reward import metrics
from everstep_reward.verifiers.base import VerifierResult
from everstep_reward.verifiers.params import VerifierParams, read_params

__all__ = ["FormatRule", "FormatRules", "FormatVerifier", "find_format_violation", "has_degenerate_repetition"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TAG_NAME = re.compile(r"^[A-Za-z][\w.-]*$")


class FormatRule(StrEnum):
    THINK_BLOCK = "think_block"
    TAGS = "tags"
    ANSWER = "answer"
    REPETITION = "repetition"


class FormatRules(VerifierParams):
    """The format verifier's options (service flags give the defaults; `VerifierSpec.params` per item)."""

    require_think: bool = Field(False, description="The response must contain a closed <think>...</think> block.")
    required_tags: tuple[str, ...] = Field(
        (), description="Tags that must each appear exactly once as a non-empty <tag>...</tag> block, e.g. answer.")
    require_boxed: bool = Field(True, description="The answer part must hold a non-empty \\boxed{}.")
    repetition_min_repeats: int = Field(
        10, ge=2, description="Back-to-back copies of one stretch of words that make a response degenerate.")
    repetition_min_words: int = Field(
        40, ge=1, description="Fewest words the repeated run must cover (so `1 1 1` in a sum is not a loop).")
    repetition_max_period: int = Field(32, ge=1, description="Longest repeated stretch looked for, in words.")

    @field_validator("required_tags")
    @classmethod
    def _check_tags(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        for tag in tags:
            if not _TAG_NAME.match(tag):
                raise ValueError(f"{tag!r} is not a tag name (write answer, not <answer>)")
        return tags


def has_degenerate_repetition(text: str, *, min_repeats: int, min_words: int, max_period: int) -> bool:
    """True when some run of words is periodic with period p <= max_period, holds >= min_repeats
    periods and >= min_words words. O(len(words) * max_period)."""
    words = text.split()
    for period in range(1, max_period + 1):
        run = 0  # positions i so far with words[i] == words[i + period], consecutively
        for i in range(len(words) - period):
            if words[i] == words[i + period]:
                run += 1
                covered = run + period
                if covered >= min_words and covered >= min_repeats * period:
                    return True
            else:
                run = 0
    return False


def _has_one_block(response: str, tag: str) -> bool:
    opening, closing = f"<{tag}>", f"</{tag}>"
    if response.count(opening) != 1 or response.count(closing) != 1:
        return False
    start, end = response.index(opening) + len(opening), response.index(closing)
    return start <= end and bool(response[start:end].strip())


def find_format_violation(response: str, rules: FormatRules) -> FormatRule | None:
    """The first rule `response` breaks, or None."""
    answer_part = response
    if THINK_OPEN in response or THINK_CLOSE in response:
        if response.count(THINK_OPEN) != 1 or response.count(THINK_CLOSE) != 1:
            return FormatRule.THINK_BLOCK
        opened, closed = response.index(THINK_OPEN), response.index(THINK_CLOSE)
        if closed < opened:
            return FormatRule.THINK_BLOCK
        answer_part = response[closed + len(THINK_CLOSE):]
    elif rules.require_think:
        return FormatRule.THINK_BLOCK
    if not all(_has_one_block(response, tag) for tag in rules.required_tags):
        return FormatRule.TAGS
    if rules.require_boxed and extract_boxed_answer(answer_part) is None:
        return FormatRule.ANSWER
    if has_degenerate_repetition(response, min_repeats=rules.repetition_min_repeats,
                                 min_words=rules.repetition_min_words, max_period=rules.repetition_max_period):
        return FormatRule.REPETITION
    return None


class FormatVerifier:
    """Scores 1.0 for a response that keeps every rule, else 0.0; reads only `params`."""

    name = "format"
    params_model = FormatRules

    def __init__(self, rules: FormatRules | None = None) -> None:
        self._rules = rules or FormatRules()

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        violation = find_format_violation(item.response, read_params(spec, self._rules))
        if violation is not None:
            metrics.FORMAT_VIOLATIONS.labels(violation.value).inc()
            return VerifierResult(0.0)
        return VerifierResult(1.0)
