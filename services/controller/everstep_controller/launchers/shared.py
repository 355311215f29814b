"""The shared launcher: every job uses the same rollout engine and trainer, one job at a time.

This is what `everstep up` and the chart's standing Deployments provide. Nothing is started or
stopped. Another job may have loaded other weights into the workers since a job last ran, so a
job resumed on shared workers always reloads its latest checkpoint (`dedicated` is False).
"""

from __future__ import annotations

from everstep.processes import wait_grpc_address
from everstep_controller.launchers.base import Launcher, WorkerRequest, Workers


class SharedLauncher(Launcher):
    kind = "shared"
    max_jobs = 1

    def __init__(self, *, rollout: str, trainer: str, ready_timeout_seconds: float = 300.0) -> None:
        """ready_timeout_seconds: how long `replace` waits for the workers to serve again."""
        if not rollout or not trainer:
            raise ValueError("the shared launcher needs the rollout and trainer addresses (--rollout, --trainer)")
        self.rollout, self.trainer = rollout, trainer
        self.ready_timeout_seconds = ready_timeout_seconds

    def launch(self, request: WorkerRequest) -> Workers:
        return Workers(launcher=self.kind, rollout=self.rollout, trainer=self.trainer, dedicated=False)

    def alive(self, workers: Workers) -> bool:
        return (workers.rollout, workers.trainer) == (self.rollout, self.trainer)

    def stop(self, workers: Workers) -> None:
        """Shared workers outlive every job."""

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str]) -> tuple[Workers, set[str]]:
        """Starts nothing (whoever runs the shared workers restarts them): waits until both serve again,
        TimeoutError after `ready_timeout_seconds`."""
        for role, address in (("rollout", self.rollout), ("trainer", self.trainer)):
            wait_grpc_address(address, self.ready_timeout_seconds, what=f"shared {role}")
        return workers, set()
