"""Multi-turn tool use inside the engine: the tools' clients (`environments`), one sequence's tool loop
(`session`) and the threads the tools run on (`runtime`). See docs/tools.md."""

from everstep_rollout.tools.runtime import ToolRuntime
from everstep_rollout.tools.session import ToolSession, TurnEnd

__all__ = ["ToolRuntime", "ToolSession", "TurnEnd"]
