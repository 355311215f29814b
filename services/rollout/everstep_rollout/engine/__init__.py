"""Generation engines: the interface the server drives, its two implementations, the factory, the loop.

- `interface`: `GenerationEngine` (the protocol), `StepStats`, `QueueFullError`, `EngineUnavailableError`.
- `factory`: `build_engine`, which picks the engine `EngineConfig.engine` names.
- `torch_engine`: `Engine`, our continuous-batching engine over a model executor (`everstep_rollout.executor`).
- `sglang_engine`: `SglangEngine`, sglang's offline engine (sglang is imported only when it is built).
- `loop`: `EngineLoop`, the thread that drives an engine.
- `sampling`, `throughput`: the torch engine's sampling; the tokens-per-second window both engines keep.
"""

from everstep_rollout.engine.factory import build_engine
from everstep_rollout.engine.interface import EngineUnavailableError, GenerationEngine, QueueFullError, StepStats
from everstep_rollout.engine.loop import EngineFailed, EngineLoop, EngineStatus, Withdrawn
from everstep_rollout.engine.torch_engine import Engine

__all__ = ["Engine", "EngineFailed", "EngineLoop", "EngineStatus", "EngineUnavailableError", "GenerationEngine",
           "QueueFullError", "StepStats", "Withdrawn", "build_engine"]
