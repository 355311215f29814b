"""The tools demo's task: multiply two numbers, answer in ``\\boxed{}`` (the math verifier checks it).

A model of a million parameters cannot multiply a three-digit number by a two-digit one in its head, but it can
copy them into ``print(a * b)`` for the ``python`` tool and copy the printed product into its answer. The warm
start's teacher does the former for most problems and the latter for a few (`TaskConfig.tool_use_probability`),
so RL has groups where the samples that called the tool are right and the others wrong. Pure Python (no torch).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Problem", "TaskConfig", "call_text", "direct_answer_text", "final_answer_text", "generate_problems",
           "split_train_eval", "write_problems"]


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Shape of the multiplications."""

    min_left: int = 200
    """Smallest left factor (200 * 50: every product has five digits, so every copy is at a fixed offset)."""
    max_left: int = 999
    """Largest left factor."""
    min_right: int = 50
    """Smallest right factor."""
    max_right: int = 99
    """Largest right factor."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_left <= self.max_left or not 0 <= self.min_right <= self.max_right:
            raise ValueError("TaskConfig: need 0 <= min_left <= max_left and 0 <= min_right <= max_right")


@dataclass(frozen=True)
class Problem:
    left: int
    right: int

    @property
    def prompt(self) -> str:
        return f"What is {self.left} * {self.right}?"

    @property
    def answer(self) -> int:
        return self.left * self.right

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": str(self.answer)}


def call_text(problem: Problem) -> str:
    """The model turn that calls the tool: a Hermes call, as Qwen2.5's template writes one (no end of turn)."""
    call = {"name": "python", "arguments": {"code": f"print({problem.left} * {problem.right})"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def final_answer_text(product: str) -> str:
    """The last model turn: the product the tool printed, boxed."""
    return f"\\boxed{{{product}}}"


def direct_answer_text(problem: Problem) -> str:
    """The turn that answers without the tool (the right product: the model can only approximate it)."""
    return final_answer_text(str(problem.answer))


def generate_problems(num: int, *, seed: int, config: TaskConfig, exclude: Iterable[str] = ()) -> list[Problem]:
    """``num`` problems, deterministic in ``seed``; prompts in ``exclude`` are never drawn (repeats allowed)."""
    rng = random.Random(seed)
    excluded = set(exclude)
    out: list[Problem] = []
    while len(out) < num:
        problem = Problem(rng.randint(config.min_left, config.max_left),
                          rng.randint(config.min_right, config.max_right))
        if problem.prompt not in excluded:
            out.append(problem)
    return out


def split_train_eval(num_train: int, num_eval: int, *, seed: int,
                     config: TaskConfig) -> tuple[list[Problem], list[Problem]]:
    """Distinct held-out problems, and training problems none of which is held out."""
    held_out: dict[str, Problem] = {}
    rng_seed = seed + 1
    while len(held_out) < num_eval:
        for p in generate_problems(num_eval - len(held_out), seed=rng_seed, config=config):
            held_out.setdefault(p.prompt, p)
        rng_seed += 1000
    return generate_problems(num_train, seed=seed, config=config, exclude=held_out), list(held_out.values())


def write_problems(path: Path, problems: Iterable[Problem]) -> None:
    """JSONL rows ``{"prompt", "answer"}``."""
    with Path(path).open("w") as f:
        for problem in problems:
            f.write(json.dumps(problem.to_row()) + "\n")
