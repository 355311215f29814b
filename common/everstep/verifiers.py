"""The reward service's verifiers and the option keys each reads from `VerifierSpec.params`.

Shared so that a caller can refuse a job's reward spec before anything is scored (the controller, at
submission: a verifier named `mathh` or an option `nonsense` is a 422 naming the field) without
importing the reward service. The reward service's own param models (`everstep_reward.verifiers`,
pydantic) stay the source of each option's type and range; its `VerifierRegistry` refuses to start
with a verifier whose options differ from this table, and tests/reward/test_verifier_table.py holds
the two together key for key.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["VERIFIER_PARAMS"]

VERIFIER_PARAMS: Mapping[str, frozenset[str]] = MappingProxyType({
    "math": frozenset({"extract"}),
    "code": frozenset({"reward_mode", "run_timeout_seconds", "compile_timeout_seconds", "memory_limit_mb"}),
    "format": frozenset({"require_think", "required_tags", "require_boxed", "repetition_min_repeats",
                         "repetition_min_words", "repetition_max_period"}),
    "length": frozenset({"max_length", "cache_length", "fallback_unit"}),
    "model": frozenset(),
    "tool_use": frozenset({"min_calls"}),
})
"""Verifier name -> the keys its `params` may hold."""

