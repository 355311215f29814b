"""Policy-loss modes by name: one module each, registered in `POLICY_LOSSES` (as verl's `register_policy_loss`),
looked up with `get_policy_loss`, which refuses an unknown name with the known ones. A new mode is a module with
its `base.PolicyLossFunction` and a line here (and a member of `everstep.settings.training.LossMode`, so that a
job can name it)."""

from __future__ import annotations

from everstep_trainer.step.losses.base import PolicyLossFunction
from everstep_trainer.step.losses.cispo import cispo_loss
from everstep_trainer.step.losses.clip_cov import clip_cov_loss
from everstep_trainer.step.losses.gspo import gspo_loss
from everstep_trainer.step.losses.kl_cov import kl_cov_loss
from everstep_trainer.step.losses.ppo import ppo_loss

__all__ = ["POLICY_LOSSES", "get_policy_loss"]

POLICY_LOSSES: dict[str, PolicyLossFunction] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}


def get_policy_loss(name: str) -> PolicyLossFunction:
    """The loss registered as `name`; ValueError naming the known ones for any other name."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"mode: unknown policy loss {name!r} (known: {known})") from None
