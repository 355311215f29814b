"""The shared table of verifiers and their option keys (everstep.verifiers), which the controller checks a
job's reward spec against at submission, agrees key for key with the reward service's own param models."""

from __future__ import annotations

import pytest

from everstep.verifiers import VERIFIER_PARAMS
from everstep_reward.verifiers import VerifierRegistry
from everstep_reward.verifiers.code import CodeVerifier
from everstep_reward.verifiers.format import FormatVerifier
from everstep_reward.verifiers.length import LengthVerifier
from everstep_reward.verifiers.math import MathVerifier
from everstep_reward.verifiers.model import ModelVerifier
from everstep_reward.verifiers.params import NoParams
from everstep_reward.verifiers.tool_use import ToolUseVerifier

SERVED = (MathVerifier, FormatVerifier, CodeVerifier, LengthVerifier, ModelVerifier, ToolUseVerifier)
"""The verifiers everstep_reward.server registers."""


def test_the_shared_table_lists_each_served_verifier_with_its_param_models_keys() -> None:
    served = {v.name: frozenset(v.params_model.model_fields) for v in SERVED}
    assert served == dict(VERIFIER_PARAMS)
    assert served["code"] >= {"reward_mode", "run_timeout_seconds"} and served["math"] == {"extract"}


def test_a_verifier_the_table_does_not_describe_is_refused_at_the_services_start() -> None:
    class Misspelled(FormatVerifier):
        name = "formatt"

    class OtherOptions(FormatVerifier):
        params_model = NoParams

    with pytest.raises(ValueError, match="'formatt' is not in everstep.verifiers.VERIFIER_PARAMS"):
        VerifierRegistry([Misspelled()])
    with pytest.raises(ValueError, match=r"'format': the options of NoParams \[\] differ"):
        VerifierRegistry([OtherOptions()])
    assert VerifierRegistry([FormatVerifier()]).names == ["format"]
