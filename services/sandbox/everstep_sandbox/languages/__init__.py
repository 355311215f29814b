"""The languages the sandbox can run: how to compile and how to run one program.

`base.py` holds the `Language` type (a language is data: see there) and the base languages
(SandboxFusion's main keys, and `c`); `sandboxfusion.py` the further keys of SandboxFusion (test
frameworks and the languages of its image). `available_languages` offers those whose tools exist.
"""

from __future__ import annotations

from everstep_sandbox.languages.base import (
    SANDBOX_PATH,
    Language,
    ProgramFiles,
    definitions,
    existing,
    tool_exists,
)
from everstep_sandbox.languages.sandboxfusion import sandboxfusion_definitions

__all__ = ["SANDBOX_PATH", "Language", "ProgramFiles", "available_languages", "existing", "tool_exists"]


def available_languages(python_executable: str = "/usr/bin/python3") -> dict[str, Language]:
    """Languages whose tools exist on this machine, by name."""
    every = [*definitions(python_executable), *sandboxfusion_definitions(python_executable)]
    return {lang.name: lang for lang in every if all(map(tool_exists, lang.required_tools))}
