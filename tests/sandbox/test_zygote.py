"""The zygote's warm interpreter stays cheap to fork."""

from __future__ import annotations

import subprocess

from everstep_sandbox.config import default_python
from everstep_sandbox.isolation.namespaces import RUNTIME_DIR


def test_zygote_preloads_no_module_with_an_at_fork_hook() -> None:
    # random, threading and logging register os.register_at_fork hooks that would run Python code
    # (and copy pages) in every forked run; the zygote must not import them.
    check = ("import sys; sys.path.insert(0, sys.argv[1]); import zygote, collections, typing; "
             "print(sorted(m for m in ('random', 'threading', 'logging') if m in sys.modules))")
    result = subprocess.run([default_python(), "-I", "-B", "-c", check, str(RUNTIME_DIR)], capture_output=True,
                            text=True, timeout=30, check=True)
    assert result.stdout == "[]\n", result.stderr
