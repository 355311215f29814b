"""The end-to-end tests' demo model: `everstep demo`'s build, shortened for CI time.

`python tests/demo_model_build.py DIR` builds it into DIR, then writes DIR/.build-exit (its exit
status). The build is the suite's longest piece of CPU work, so it starts as early as it can:
`make test` (scripts/test.sh) starts it before its last installs and hands DIR to pytest in
`EVERSTEP_TEST_DEMO_MODEL`; a plain `pytest` run starts it at collection (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUILD_ARGS = ("--no-eval", "--max-ops", "8", "--batch-size", "64", "--sft-steps", "480")
"""Chains of at most 8 operations, batches of 64 and 480 first-phase steps, and no scoring: about 2
minutes of CPU. The short chains and small batches learn the worked procedure well enough in that time
that ten RL steps raise the reward clearly (from about 0.2 to 0.35); the full task's 120 steps at
batches of 256, which took twice as long, left it near 0.1 and a rise within the noise."""
EXIT_FILE = ".build-exit"
"""Written into the model folder when the build ends: its exit status."""
PID_FILE = ".build-pid"
"""Written into the model folder when the build starts: the pid of this script."""


def build(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / PID_FILE).write_text(str(os.getpid()))
    status = subprocess.call([sys.executable, "-m", "everstep_tools.demo", "--out", str(out), *BUILD_ARGS])
    partial = out / (EXIT_FILE + ".tmp")
    partial.write_text(str(status))
    partial.replace(out / EXIT_FILE)
    return status


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/demo_model_build.py DIR")
    sys.exit(build(Path(sys.argv[1])))
