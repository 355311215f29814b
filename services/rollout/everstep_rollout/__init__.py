"""everstep rollout service."""
