"""Verifiers by name. An item naming a verifier that is not registered gets an error, not a zero."""

from __future__ import annotations

from collections.abc import Iterable

from everstep.verifiers import VERIFIER_PARAMS
from everstep_reward.verifiers.base import Verifier, VerifierResult
from everstep_reward.verifiers.params import SpecError

__all__ = ["SpecError", "Verifier", "VerifierRegistry", "VerifierResult"]


class VerifierRegistry:
    def __init__(self, verifiers: Iterable[Verifier]) -> None:
        self._verifiers: dict[str, Verifier] = {}
        for verifier in verifiers:
            if verifier.name in self._verifiers:
                raise ValueError(f"two verifiers named {verifier.name!r}")
            _check_shared_table(verifier)
            self._verifiers[verifier.name] = verifier

    @property
    def names(self) -> list[str]:
        return sorted(self._verifiers)

    def get(self, name: str) -> Verifier | None:
        return self._verifiers.get(name)


def _check_shared_table(verifier: Verifier) -> None:
    """Callers check a job's verifiers and params against everstep.verifiers.VERIFIER_PARAMS before
    scoring; a verifier that table does not describe exactly would let them pass bad params or refuse
    good ones, so it is refused here, at the service's start."""
    if verifier.name not in VERIFIER_PARAMS:
        raise ValueError(f"verifier {verifier.name!r} is not in everstep.verifiers.VERIFIER_PARAMS")
    options, listed = frozenset(verifier.params_model.model_fields), VERIFIER_PARAMS[verifier.name]
    if options != listed:
        raise ValueError(f"verifier {verifier.name!r}: the options of {verifier.params_model.__name__} "
                         f"{sorted(options)} differ from everstep.verifiers.VERIFIER_PARAMS {sorted(listed)}")
