"""Launchers give each job its own rollout engine and trainer, and stop them when it ends.

- `local`: two processes on this machine, on free ports, each in its own process group.
- `kubernetes`: a Deployment and a Service per worker, made from the chart's PodTemplates.
- `shared`: no launching at all: every job uses the same two workers (those `everstep up`
  starts), so only one job runs at a time.

A launcher knows nothing of Redis or jobs' progress: it returns a `Workers` record that the
runner stores, and is given it back to check or stop the workers after a controller restart.
"""

from everstep_controller.launchers.base import Launcher, WorkerRequest, Workers

__all__ = ["Launcher", "WorkerRequest", "Workers", "make_launcher"]


def make_launcher(kind: str, **options: object) -> Launcher:
    """The launcher of a kind ('local', 'kubernetes' or 'shared') with its options."""
    if kind == "local":
        from everstep_controller.launchers.local import LocalLauncher

        return LocalLauncher(**options)  # type: ignore[arg-type]
    if kind == "kubernetes":
        from everstep_controller.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher(**options)  # type: ignore[arg-type]
    if kind == "shared":
        from everstep_controller.launchers.shared import SharedLauncher

        return SharedLauncher(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown launcher {kind!r}: use local, kubernetes or shared")
