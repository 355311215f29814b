"""The languages the sandbox can run: how to compile and how to run one program.

A language is data, not code: the runner writes `source_file` into a fresh work directory,
runs `compile_argv` there (if any), then `run_argv`. Adding a language is adding an entry to
`_DEFINITIONS`; it is offered only when every tool in `required_tools` is on PATH.
Language names follow SandboxFusion's (`python`, `cpp`, `bash`, ...); `c` is an everstep addition.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass

__all__ = ["Language", "available_languages"]


@dataclass(frozen=True, kw_only=True)
class Language:
    name: str
    """Request name of the language (SandboxFusion spelling)."""
    source_file: str
    """File name the code is written to inside the work directory."""
    run_argv: tuple[str, ...]
    """Command that runs the program, relative to the work directory."""
    compile_argv: tuple[str, ...] | None = None
    """Command that builds the program; None for interpreted languages."""
    required_tools: tuple[str, ...] = ()
    """Executables that must be on PATH (or absolute paths) for the language to be offered."""
    limit_address_space: bool = True
    """Apply RLIMIT_AS (memory_limit_MB) to the run; off where a runtime reserves large virtual memory."""
    limit_processes: bool = True
    """Apply RLIMIT_NPROC to the run; off where the language forks as a matter of course (shells)."""

    @property
    def is_compiled(self) -> bool:
        return self.compile_argv is not None


def _definitions(python_executable: str) -> list[Language]:
    return [
        Language(name="python", source_file="solution.py", run_argv=(python_executable, "-u", "solution.py"),
                 required_tools=(python_executable,)),
        Language(name="bash", source_file="solution.sh", run_argv=("bash", "solution.sh"),
                 required_tools=("bash",), limit_address_space=False, limit_processes=False),
        Language(name="cpp", source_file="solution.cpp",
                 compile_argv=("g++", "-O2", "-std=c++17", "-o", "solution", "solution.cpp"),
                 run_argv=("./solution",), required_tools=("g++",)),
        Language(name="c", source_file="solution.c",
                 compile_argv=("gcc", "-O2", "-std=c11", "-o", "solution", "solution.c", "-lm"),
                 run_argv=("./solution",), required_tools=("gcc",)),
    ]


def available_languages(python_executable: str | None = None) -> dict[str, Language]:
    """Languages whose tools exist on this machine, by name."""
    definitions = _definitions(python_executable or sys.executable)
    return {lang.name: lang for lang in definitions if all(shutil.which(t) for t in lang.required_tools)}
