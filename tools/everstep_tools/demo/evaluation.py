"""Held-out accuracy of a demo model: greedy, and avg@k sampled at a temperature.

The answer check here is a fast exact match on the ``\\boxed{ N }`` the task writes; the platform's
reward service uses math-verify, which agrees on this format (tests check both).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from everstep_tools.demo.task import Problem

__all__ = ["EvalResult", "boxed_answer", "evaluate", "generate_completions", "is_correct"]

_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def boxed_answer(text: str) -> str | None:
    """The last ``\\boxed{ N }`` in ``text``, or None."""
    found = _BOXED.findall(text)
    return found[-1] if found else None


def is_correct(completion: str, answer: str) -> bool:
    return boxed_answer(completion) == answer


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: Sequence[str], *, temperature: float, max_new_tokens: int,
                         batch_size: int = 256) -> list[list[int]]:
    """One completion (token ids, EOS included when produced) per prompt; ``temperature`` 0 is greedy.

    Prompts are batched in order: callers sort them by length so each batch stops early together.
    """
    out: list[list[int]] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[start:start + batch_size]), return_tensors="pt", padding=True)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        generated = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=eos, **sampling)
        for row in generated[:, enc.input_ids.shape[1]:].tolist():
            out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


@dataclass
class EvalResult:
    greedy_accuracy: float
    sampled_accuracy: float
    """avg@k: mean correctness over k samples per problem at ``temperature``."""
    num_problems: int
    num_samples: int
    temperature: float
    seconds: float
    sampled_accuracy_by_num_ops: dict[str, float]
    """avg@k per bucket of chain length ("1", "2", "3-4", "5-8", "9-16", "17+")."""


def _bucket(num_ops: int) -> str:
    for upper, name in ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16")):
        if num_ops <= upper:
            return name
    return "17+"


def evaluate(model, tokenizer, problems: Sequence[Problem], *, num_samples: int = 8, temperature: float = 1.0,
             max_new_tokens: int = 256, batch_size: int = 256) -> EvalResult:
    started = time.monotonic()
    model.eval()
    ordered = sorted(problems, key=lambda p: p.num_ops)
    prompts = [p.prompt for p in ordered]
    greedy = generate_completions(model, tokenizer, prompts, temperature=0.0, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size)
    greedy_hits = [is_correct(tokenizer.decode(c, skip_special_tokens=True), str(p.answer))
                   for c, p in zip(greedy, ordered, strict=True)]
    repeated = [p for p in ordered for _ in range(num_samples)]
    sampled = generate_completions(model, tokenizer, [p.prompt for p in repeated], temperature=temperature,
                                   max_new_tokens=max_new_tokens, batch_size=batch_size)
    sampled_hits = [is_correct(tokenizer.decode(c, skip_special_tokens=True), str(p.answer))
                    for c, p in zip(sampled, repeated, strict=True)]
    buckets: dict[str, list[bool]] = {}
    for hit, p in zip(sampled_hits, repeated, strict=True):
        buckets.setdefault(_bucket(p.num_ops), []).append(hit)
    return EvalResult(
        greedy_accuracy=sum(greedy_hits) / len(greedy_hits),
        sampled_accuracy=sum(sampled_hits) / len(sampled_hits),
        num_problems=len(problems), num_samples=num_samples, temperature=temperature,
        seconds=time.monotonic() - started,
        sampled_accuracy_by_num_ops={k: round(sum(v) / len(v), 4) for k, v in buckets.items()},
    )
