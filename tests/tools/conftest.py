"""Fixtures of the tools tests (the shared ones, `tiny_model_dir` among them, are in tests/conftest.py)."""

from __future__ import annotations

import torch

# The tiny models train in-process on a few tokens: with more intra-op threads than free cores (this machine is
# shared) each matrix multiply waits on spinning OpenMP workers (as in tests/trainer/conftest.py).
torch.set_num_threads(1)
