"""Loads a user's reward function from its source and calls it on rows; what either convention returns is
read into a `FunctionScore` per row here, so that a failure of the user's code is a value, never an exception.

verl's functions are called once per row. TRL's are called once per batch of rows (`call_batch`: lists of the
rows' prompts, completions and answers), as TRL calls them once per generation batch; what the call returns is
mapped back to the rows in order. A call that raises, or returns something that is not a list with one entry per
row, fails every row of the batch with that text; an entry that is neither a finite number nor None fails its row.

Imports go through an allowlist: the module runs with its own `__builtins__`, whose `__import__` refuses a
module (and any submodule of one) the operator did not list, and relative imports. That is a rule for honest
code, not a wall: Python code can reach other modules through objects it is given. The walls are the worker
process's (`isolation`); the in-process mode, an operator's choice for trusted code, has only this rule.

Runs in the function's worker process (`load` from its initializer, `call_loaded_batch` per call): both are
top-level so that they pickle.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import inspect
import math
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from everstep.reward_functions import FunctionConvention, FunctionSourceError, convention_of

__all__ = ["FunctionRow", "FunctionScore", "LoadedFunction", "call_loaded_batch", "load", "load_function"]


@dataclass(frozen=True)
class FunctionRow:
    """What a function reads of one reward item."""

    prompt: str
    response: str
    ground_truth: str
    data_source: str = ""


@dataclass(frozen=True)
class FunctionScore:
    score: float | None = None
    """None: TRL's "does not apply to this row" (scores 0, no error), or an error."""
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    """The row could not be scored: the exception's text, or what was wrong with the value returned."""
    load_error: str = ""
    """The function could not be loaded (it fails every row: the job's reward spec is wrong)."""


@dataclass
class LoadedFunction:
    name: str
    path: str
    fn: Callable[..., Any] | None
    convention: FunctionConvention | None
    accepted: frozenset[str] | None
    """The keyword arguments it takes; None: any (it has **kwargs)."""
    load_error: str = ""

    def call(self, row: FunctionRow) -> FunctionScore:
        """One row: verl's function per row, TRL's with lists of one."""
        return self.call_batch([row])[0]

    def call_batch(self, rows: Sequence[FunctionRow]) -> list[FunctionScore]:
        """One FunctionScore per row, in order: verl's function called per row, TRL's once for all of them."""
        if self.fn is None or self.convention is None:
            return [FunctionScore(load_error=self.load_error)] * len(rows)
        if self.convention == FunctionConvention.VERL:
            return [self._call_verl(row) for row in rows]
        answers = [row.ground_truth for row in rows]
        try:
            value = self._run(prompts=[row.prompt for row in rows], completions=[row.response for row in rows],
                              answer=answers, ground_truth=list(answers))
        except Exception as e:  # the user's code: its failure is every row's of the call
            return [FunctionScore(error=_describe(e, self.path))] * len(rows)
        return _trl_scores(value, len(rows))

    def _call_verl(self, row: FunctionRow) -> FunctionScore:
        try:
            value = self._run(data_source=row.data_source, solution_str=row.response, ground_truth=row.ground_truth,
                              extra_info={})
        except Exception as e:  # the user's code: its failure is this row's
            return FunctionScore(error=_describe(e, self.path))
        return _verl_score(value)

    def _run(self, **arguments: Any) -> Any:
        assert self.fn is not None
        if self.accepted is not None:
            arguments = {k: v for k, v in arguments.items() if k in self.accepted}
        value = self.fn(**arguments)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return value


async def _awaited(value: Any) -> Any:
    return await value


def load_function(source: str, name: str, path: str, allowed_imports: Iterable[str]) -> LoadedFunction:
    """Runs the module's source with the import allowlist and finds `name` in it; a LoadedFunction with
    `load_error` set if it cannot."""
    allowed = frozenset(allowed_imports)
    module_name = "everstep_reward_function_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    namespace: dict[str, Any] = {"__name__": module_name, "__file__": path,
                                 "__builtins__": {**vars(builtins), "__import__": _guarded_import(allowed)}}
    try:
        exec(compile(source, path, "exec"), namespace)  # noqa: S102  # the user's module, isolated by the caller
        fn = namespace.get(name)
        if not callable(fn):
            raise FunctionSourceError(f"{path} defines no function {name!r}")
        parameters = inspect.signature(fn).parameters
        convention = convention_of(list(parameters), name)
    except Exception as e:
        return LoadedFunction(name, path, None, None, None, f"cannot load {name} from {path}: {_describe(e, path)}")
    any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = None if any_keyword else frozenset(parameters)
    return LoadedFunction(name, path, fn, convention, accepted)


def _guarded_import(allowed: frozenset[str]) -> Callable[..., Any]:
    real_import = builtins.__import__

    def guarded(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level:
            raise ImportError(f"relative import of {name!r}: a reward function is one file")
        top = name.partition(".")[0]
        if top not in allowed:
            raise ImportError(f"import of {name!r} is not allowed in a reward function (allowed: "
                              f"{', '.join(sorted(allowed))}; set by the reward service's --function-allowed-imports)")
        return real_import(name, globals, locals, fromlist, level)

    return guarded


def _verl_score(value: Any) -> FunctionScore:
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return FunctionScore(error=f"returned a dict without 'score' (keys: {sorted(map(str, value))})")
        metrics = {str(k): float(v) for k, v in value.items()
                   if k != "score" and _is_number(v) and math.isfinite(float(v))}
        value = value["score"]
    if not _is_number(value) or not math.isfinite(float(value)):
        return FunctionScore(error=f"returned {_short(value)}, not a finite number")
    return FunctionScore(score=float(value), metrics=metrics)


def _trl_scores(value: Any, rows: int) -> list[FunctionScore]:
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
        value = value.tolist()  # TRL reads any sequence of numbers
    if not isinstance(value, list | tuple):
        return [FunctionScore(error=f"returned {_short(value)}, not a list with one score per completion "
                                    f"({rows})")] * rows
    if len(value) != rows:
        return [FunctionScore(error=f"returned {len(value)} scores ({_short(value)}) for {rows} "
                                    f"completion{'' if rows == 1 else 's'}: it must return one score per completion, "
                                    "in order")] * rows
    return [_trl_entry(score, index, rows) for index, score in enumerate(value)]


def _trl_entry(score: Any, index: int, rows: int) -> FunctionScore:
    if score is None:
        return FunctionScore()
    if not _is_number(score) or not math.isfinite(float(score)):
        where = f"[{_short(score)}]" if rows == 1 else f"{_short(score)} at index {index} of {rows}"
        return FunctionScore(error=f"returned {where}: a score must be a finite number or None")
    return FunctionScore(score=float(score))


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return isinstance(value, int | float) or type(value).__module__.startswith("numpy")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(error: BaseException, path: str) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    where = f" ({path}, line {frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


_LOADED: LoadedFunction | None = None


def load(source: str, name: str, path: str, allowed_imports: tuple[str, ...]) -> None:
    """A worker's initializer: loads the one function this worker runs."""
    global _LOADED
    _LOADED = load_function(source, name, path, allowed_imports)


def call_loaded_batch(rows: list[FunctionRow]) -> list[FunctionScore]:
    """Calls the worker's function on a batch of rows (TRL's: once)."""
    assert _LOADED is not None, "the worker's initializer did not run"
    return _LOADED.call_batch(rows)
