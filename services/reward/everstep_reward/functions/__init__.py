"""The user's reward functions: loaded from the source a job ships, run in isolated worker processes."""

from everstep_reward.functions.verifier import FunctionSettings, FunctionVerifier

__all__ = ["FunctionSettings", "FunctionVerifier"]
