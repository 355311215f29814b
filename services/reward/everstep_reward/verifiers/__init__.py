"""Verifiers by name. An item naming a verifier that is not registered gets an error, not a zero."""

from __future__ import annotations

from collections.abc import Iterable

from everstep_reward.verifiers.base import ErrorKind, Verifier, VerifierResult
from everstep_reward.verifiers.params import SpecError

__all__ = ["ErrorKind", "SpecError", "Verifier", "VerifierRegistry", "VerifierResult"]


class VerifierRegistry:
    def __init__(self, verifiers: Iterable[Verifier]) -> None:
        self._verifiers: dict[str, Verifier] = {}
        for verifier in verifiers:
            if verifier.name in self._verifiers:
                raise ValueError(f"two verifiers named {verifier.name!r}")
            self._verifiers[verifier.name] = verifier

    @property
    def names(self) -> list[str]:
        return sorted(self._verifiers)

    def get(self, name: str) -> Verifier | None:
        return self._verifiers.get(name)
