from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model as `everstep demo` builds it, with half the warm start (CI time) and no scoring."""
    out = tmp_path_factory.mktemp("demo-model")
    subprocess.run([sys.executable, "-m", "everstep_trainer.demo", "--out", str(out), "--no-eval",
                    "--sft-steps", "150"], check=True, timeout=900)
    return out
