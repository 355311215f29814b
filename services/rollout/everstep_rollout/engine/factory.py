"""The factory that builds the configured engine.

`EngineConfig.engine` picks it: "torch" (`torch_engine.Engine`, the default, CPU or GPU) or "sglang"
(`sglang_engine.SglangEngine`, GPU, in its own environment: `make sglang-venv`). sglang is imported only
when selected.
"""

from __future__ import annotations

from pathlib import Path

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine.interface import GenerationEngine


def build_engine(model_dir: str | Path, config: EngineConfig) -> GenerationEngine:
    """The engine config.engine names; EngineUnavailableError (naming the extra) when sglang is missing."""
    if config.engine == "sglang":
        from everstep_rollout.engine.sglang_engine import SglangEngine

        return SglangEngine(model_dir, config)
    from everstep_rollout.engine.torch_engine import Engine

    return Engine(model_dir, config)
