"""The demo's synthetic task: chains of + and - with a worked, verifiable solution.

A problem is a chain whose operations carry labels, like ``7 a + 3 b - 5 c + 8 =``; its worked
solution spells out every step, named by its label, and ends with the answer in ``\\boxed{}``::

    a 7 + 3 = 10 , b 10 - 5 = 5 , c 5 + 8 = 13 \\boxed{ 13 }

The labels make "which operation comes next" a lookup by content (find label ``b`` in the prompt,
copy what follows) instead of counting positions, which a model of a million parameters learns in a
short warm start; what is left hard is the arithmetic and not slipping over a long chain.

Every number is one whole token (the tokenizer is word-level), so a step is a single prediction
rather than a string of digits. The number of operations is long-tailed (most chains have 1-4
operations, a few up to ``max_ops``), so solutions run from a few tokens to a few hundred: errors
compound on long chains, which is what leaves sampled accuracy in the middle after a short warm
start and gives RL groups with mixed rewards. Pure Python (no torch), so any service may use it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Problem",
    "TaskConfig",
    "generate_problems",
    "parse_prompt",
    "read_problems",
    "solution_text",
    "split_train_eval",
    "write_problems",
]

BOXED_OPEN = "\\boxed{"
BOXED_CLOSE = "}"
LABELS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Shape of the arithmetic chains."""

    max_value: int = 19
    """Running values (and starting numbers) stay in 0..max_value."""
    max_operand: int = 5
    """Each operation adds or subtracts a number in 1..max_operand."""
    max_ops: int = 24
    """Longest chain (number of operations; at most 26, one label letter each)."""
    tail_exponent: float = 1.5
    """P(num_ops = n) is proportional to n ** -tail_exponent: smaller means a heavier tail."""

    def __post_init__(self) -> None:
        if self.max_value < 2:
            raise ValueError("TaskConfig.max_value must be >= 2")
        if not 1 <= self.max_operand <= self.max_value:
            raise ValueError("TaskConfig.max_operand must be in 1..max_value")
        if not 1 <= self.max_ops <= len(LABELS):
            raise ValueError(f"TaskConfig.max_ops must be in 1..{len(LABELS)}")
        if self.tail_exponent <= 0:
            raise ValueError("TaskConfig.tail_exponent must be > 0")

    def words(self) -> list[str]:
        """Every word a prompt or solution can contain (the tokenizer's vocabulary, less specials)."""
        return (["+", "-", "=", ",", BOXED_OPEN, BOXED_CLOSE] + [str(i) for i in range(self.max_value + 1)]
                + list(LABELS[: self.max_ops]))


@dataclass(frozen=True)
class Problem:
    """One chain: ``start`` followed by signed ``operands`` (+3 adds 3, -5 subtracts 5)."""

    start: int
    operands: tuple[int, ...]

    @property
    def num_ops(self) -> int:
        return len(self.operands)

    @property
    def prompt(self) -> str:
        parts = [str(self.start)]
        for label, operand in zip(LABELS, self.operands, strict=False):
            parts += [label, "+" if operand > 0 else "-", str(abs(operand))]
        return " ".join(parts) + " ="

    @property
    def values(self) -> list[int]:
        """Running values after each operation."""
        value, out = self.start, []
        for operand in self.operands:
            value += operand
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": str(self.answer), "num_ops": self.num_ops}


def solution_text(problem: Problem, *, slip_probability: float = 0.0, direct_answer_probability: float = 0.0,
                  rng: random.Random | None = None, max_value: int | None = None) -> str:
    """The worked solution a warm start imitates (no EOS: the tokenizer's caller appends it).

    With ``direct_answer_probability`` > 0 the teacher, with that probability, skips the working and
    writes only the (right) boxed answer. A model cannot compute a long chain in one token, so a warm
    start on such a mix samples "answer at once" often and is then usually wrong: RL learns to show
    its work (solutions get longer as accuracy rises, the R1-Zero curve).

    With ``slip_probability`` > 0 it is a sloppy teacher's solution: each step's result is, with that
    probability, written off by one (up or down, whichever keeps the rest of the chain inside
    0..``max_value``), and the chain carries on from the written value, so the boxed answer is wrong.
    A warm start on such solutions knows the procedure (its argmax is right) but slips when it
    samples: the kind of error that RL with a verifier removes.
    """
    if slip_probability and (rng is None or max_value is None):
        raise ValueError("solution_text: a slip_probability needs rng and max_value")
    if direct_answer_probability:
        if rng is None:
            raise ValueError("solution_text: a direct_answer_probability needs rng")
        if rng.random() < direct_answer_probability:
            return f"{BOXED_OPEN} {problem.answer} {BOXED_CLOSE}"
    steps, value = [], problem.start
    for index, (label, operand) in enumerate(zip(LABELS, problem.operands, strict=False)):
        result = value + operand
        if slip_probability and rng.random() < slip_probability:
            result = _slipped(result, problem.operands[index + 1:], rng, max_value)
        sign = "+" if operand > 0 else "-"
        steps.append(f"{label} {value} {sign} {abs(operand)} = {result}")
        value = result
    return " , ".join(steps) + f" {BOXED_OPEN} {value} {BOXED_CLOSE}"


def _slipped(result: int, rest: tuple[int, ...], rng: random.Random, max_value: int) -> int:
    """``result`` off by one, in a direction that keeps every later running value in range (or as is)."""
    offsets = [1, -1]
    rng.shuffle(offsets)
    for offset in offsets:
        value, ok = result + offset, 0 <= result + offset <= max_value
        for operand in rest:
            value += operand
            ok = ok and 0 <= value <= max_value
        if ok:
            return result + offset
    return result


def parse_prompt(prompt: str) -> Problem:
    """Inverse of ``Problem.prompt``."""
    words = prompt.split()
    if len(words) < 5 or words[-1] != "=" or (len(words) - 2) % 3 != 0:
        raise ValueError(f"not a chain prompt: {prompt!r}")
    operands = []
    triples = zip(words[1:-1:3], words[2:-1:3], words[3:-1:3], strict=True)
    for index, (label, sign, number) in enumerate(triples):
        if sign not in ("+", "-") or label != LABELS[index]:
            raise ValueError(f"not a chain prompt: {prompt!r}")
        operands.append(int(number) if sign == "+" else -int(number))
    return Problem(int(words[0]), tuple(operands))


def _num_ops(rng: random.Random, config: TaskConfig) -> int:
    weights = [n ** -config.tail_exponent for n in range(1, config.max_ops + 1)]
    return rng.choices(range(1, config.max_ops + 1), weights=weights)[0]


def _problem(rng: random.Random, config: TaskConfig) -> Problem:
    value = rng.randint(0, config.max_value)
    operands = []
    for _ in range(_num_ops(rng, config)):
        # Only operations that keep the running value in range: every step is a valid token.
        choices = [d for d in range(1, config.max_operand + 1) if value + d <= config.max_value]
        choices += [-d for d in range(1, config.max_operand + 1) if value - d >= 0]
        operand = rng.choice(choices)
        operands.append(operand)
        value += operand
    return Problem(value - sum(operands), tuple(operands))


def generate_problems(num: int, *, seed: int, config: TaskConfig | None = None,
                      exclude: Iterable[str] = (), distinct: bool = True) -> list[Problem]:
    """``num`` problems, deterministic in ``seed``; prompts in ``exclude`` are never drawn.

    ``distinct=False`` lets prompts repeat, which keeps the ``num_ops`` distribution exact (there are
    only a few hundred one-operation chains).
    """
    config = config or TaskConfig()
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot draw {num} distinct problems from this TaskConfig")
        problem = _problem(rng, config)
        if problem.prompt not in seen:
            if distinct:
                seen.add(problem.prompt)
            out.append(problem)
    return out


def split_train_eval(num_train: int, num_eval: int, *, seed: int,
                     config: TaskConfig | None = None) -> tuple[list[Problem], list[Problem]]:
    """Disjoint sets: distinct held-out prompts, and training prompts (repeats allowed) none of which is held out."""
    eval_problems = generate_problems(num_eval, seed=seed + 1, config=config)
    train = generate_problems(num_train, seed=seed, config=config,
                              exclude=[p.prompt for p in eval_problems], distinct=False)
    return train, eval_problems


def write_problems(path: Path, problems: Iterable[Problem]) -> None:
    """JSONL rows ``{"prompt", "answer", "num_ops"}``."""
    with Path(path).open("w") as f:
        for problem in problems:
            f.write(json.dumps(problem.to_row()) + "\n")


def read_problems(path: Path) -> Iterator[Problem]:
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield parse_prompt(json.loads(line)["prompt"])
