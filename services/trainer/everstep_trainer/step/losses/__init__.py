"""Policy-gradient losses as pure functions: one module per loss mode (`ppo`, `gspo`, `cispo`, `clip_cov`,
`kl_cov`) registered by name in `registry`, the training/inference mismatch correction (`correction`), the KL
estimators (`kl`), the aggregations (`aggregation`), and `policy.policy_loss`, which puts them together."""

from everstep_trainer.step.losses.aggregation import aggregate_token_loss, loss_normalizer
from everstep_trainer.step.losses.base import PolicyLossFunction, TokenPolicyLoss
from everstep_trainer.step.losses.correction import (
    MismatchDiagnostics,
    MismatchSums,
    mismatch_diagnostics,
    mismatch_sums,
    mismatch_weight,
    staleness_masks,
)
from everstep_trainer.step.losses.kl import adaptive_kl_coef, k3_divergence, kl_divergence
from everstep_trainer.step.losses.policy import PolicyLossStats, loss_settings, policy_loss, token_policy_loss
from everstep_trainer.step.losses.registry import POLICY_LOSSES, get_policy_loss

__all__ = [
    "POLICY_LOSSES",
    "MismatchDiagnostics",
    "MismatchSums",
    "PolicyLossFunction",
    "PolicyLossStats",
    "TokenPolicyLoss",
    "adaptive_kl_coef",
    "aggregate_token_loss",
    "get_policy_loss",
    "k3_divergence",
    "kl_divergence",
    "loss_normalizer",
    "loss_settings",
    "mismatch_diagnostics",
    "mismatch_sums",
    "mismatch_weight",
    "policy_loss",
    "staleness_masks",
    "token_policy_loss",
]
