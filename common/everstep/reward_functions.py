"""A user's reward function, as a job names it (`reward.functions[]`: a file's `path` and a function `name`):
how its convention is told from its signature, and the check of its source that the controller runs at
submission without executing a line of it.

Two conventions, told apart by the parameters' names (docs/reward.md, "Reward functions"):

- verl's per-row `compute_score(data_source, solution_str, ground_truth, extra_info)`: one call per
  response, returning a number or a dict with `score` (its other keys are reported as metrics).
- TRL's batch `f(prompts, completions, **columns)`: lists in, a list of `float | None` out; the reward
  service calls it once per Score call with every row of it that runs the function.

A function whose parameters include `completions` is TRL's; one whose parameters include `solution_str` is
verl's; any other is refused. `async def` works in both.
"""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import PurePath

__all__ = ["FUNCTION_VERIFIER", "FunctionConvention", "FunctionSourceError", "SourceSyntaxError",
           "check_function_source", "convention_of", "part_name"]

FUNCTION_VERIFIER = "function"
"""`VerifierSpec.name` (and `RewardPart.verifier`) of a user's function; not a verifier a job may name."""


def part_name(path: str, name: str) -> str:
    """How results name a function's part (`RewardPart.verifier`): `function:<file stem>.<name>`, e.g.
    `function:math_reward.compute_score`; a job's functions must differ in it."""
    return f"{FUNCTION_VERIFIER}:{PurePath(path).stem}.{name}"


class FunctionConvention(StrEnum):
    VERL = "verl"
    """compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (per row)."""
    TRL = "trl"
    """f(prompts, completions, **columns) -> list[float | None] (per batch)."""


class FunctionSourceError(ValueError):
    """The source lacks the function, or its signature follows neither convention."""


class SourceSyntaxError(FunctionSourceError):
    """The source does not parse."""


def convention_of(parameter_names: list[str], name: str) -> FunctionConvention:
    """The convention of a function with these parameters; FunctionSourceError naming both for another."""
    if "completions" in parameter_names:
        return FunctionConvention.TRL
    if "solution_str" in parameter_names:
        return FunctionConvention.VERL
    raise FunctionSourceError(
        f"function {name!r}({', '.join(parameter_names)}) follows neither convention: verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) or TRL's f(prompts, completions, **kwargs)")


def check_function_source(source: str, name: str, filename: str) -> FunctionConvention:
    """Parses `source` (never runs it) and finds the top-level `def name` or `async def name`; its convention, or
    FunctionSourceError saying what is wrong."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise SourceSyntaxError(f"{filename} does not parse: {e.msg} (line {e.lineno})") from None
    except ValueError as e:  # null bytes
        raise SourceSyntaxError(f"{filename} does not parse: {e}") from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            return convention_of(names, name)
    defined = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    raise FunctionSourceError(f"{filename} defines no top-level function {name!r} "
                              f"(its functions: {', '.join(defined) or 'none'})")
