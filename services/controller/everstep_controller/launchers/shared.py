"""The shared launcher: every job uses the same rollout engine and trainer, one job at a time.

This is what `everstep up` and the chart's standing Deployments provide. Nothing is started or
stopped. Another job may have loaded other weights into the workers since a job last ran, so a
job resumed on shared workers always reloads its latest checkpoint (`dedicated` is False).
"""

from __future__ import annotations

from everstep_controller.launchers.base import Launcher, WorkerRequest, Workers


class SharedLauncher(Launcher):
    kind = "shared"
    max_jobs = 1

    def __init__(self, *, rollout: str, trainer: str) -> None:
        if not rollout or not trainer:
            raise ValueError("the shared launcher needs the rollout and trainer addresses (--rollout, --trainer)")
        self.rollout, self.trainer = rollout, trainer

    def launch(self, request: WorkerRequest) -> Workers:
        return Workers(launcher=self.kind, rollout=self.rollout, trainer=self.trainer, dedicated=False)

    def alive(self, workers: Workers) -> bool:
        return (workers.rollout, workers.trainer) == (self.rollout, self.trainer)

    def stop(self, workers: Workers) -> None:
        """Shared workers outlive every job."""
