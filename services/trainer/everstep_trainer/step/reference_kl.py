"""The KL term in the reward (`TrainerConfig.kl_in_reward`; verl's `use_kl_in_reward`): each sample's KL to the
frozen reference, summed over its output tokens, for the controller to subtract (times the coefficient) from the
sample's score before the advantages.

kl_t is the config's `kl_estimator` of log pi_ref - log pi_theta at output token t, pi_theta being the trainer's own
log-probs under its current weights: the policy the next train step trains, whose log-probs that step takes as
its old log-probs (as verl's `apply_kl_penalty` takes the actor's `old_log_probs`). Not the engine's recorded
log-probs: those carry the training/inference mismatch (other kernels, other precision), which would count as KL
to the reference even where the policy is the reference (step 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from everstep_trainer.step.losses import kl_divergence

__all__ = ["ReferenceKl", "sequence_kl_sums"]


@dataclass(frozen=True)
class ReferenceKl:
    """A batch's KL to the reference, for its rewards."""

    kl_sums: list[float]
    """Per sample: sum over its output tokens (tool tokens left out) of kl_t."""
    kl_coef: float
    """The coefficient to subtract the sums with: config.kl_coef, or with kl_target as adapted by the steps before."""
    num_tokens: int
    """The output tokens summed over (of every sample)."""

    @property
    def kl_mean(self) -> float:
        """Mean kl_t per token over the batch (0.0 without tokens): what the adaptive coefficient follows."""
        return sum(self.kl_sums) / self.num_tokens if self.num_tokens else 0.0


def sequence_kl_sums(policy_logp: Tensor, reference_logp: Tensor, output_mask: Tensor, estimator: str, *,
                     max_log_ratio: float | None = None) -> Tensor:
    """[B] sum of kl_t over each row's `output_mask` tokens, from [B, L] log-probs of the same tokens under the policy
    and the reference (`losses.kl_divergence`; `max_log_ratio` bounds k3's exponent)."""
    kl = kl_divergence(reference_logp - policy_logp, estimator, max_log_ratio=max_log_ratio)
    return kl.masked_fill(~output_mask, 0.0).sum(dim=1)
