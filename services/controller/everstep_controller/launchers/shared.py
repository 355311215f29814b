"""The shared launcher: every job uses the same standing rollout engines and trainer, one job at a time.

This is what `everstep up` and the chart's standing Deployments provide. A job whose pool
(`resources.rollout.replicas`) is no larger than the standing engines (`--rollout a,b,...`) gets that many of
them, and nothing is started or stopped. An entry `dns:///name:port` stands for every address the name resolves
to (IPv4), resolved again at each launch and check: the chart passes its headless Service
`<release>-rollout-pods`, so the pool follows the shared Deployment's pods as they come and go. A job that asks
for more engines than stand gets the rest started for it as local processes (`engines_on_demand`, which
`everstep up` sets; they are stopped with the job), or, without it, fails at launch with the reason: never a
silent smaller pool.
The standing trainer is one trainer, however many nodes it runs on itself: a job that asks for trainer nodes of
its own (`resources.trainer.replicas` > 1) fails at launch with the reason too.

Another job may have loaded other weights into the workers since a job last ran, so a job resumed on shared
workers always reloads its latest checkpoint (`dedicated` is False).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Collection

from everstep.processes import ManagedProcess, is_alive, wait_grpc_address
from everstep_controller.launchers.base import Launcher, ProcessHandle, WorkerRequest, Workers
from everstep_controller.launchers.local import LocalLauncher

log = logging.getLogger(__name__)


def resolve(targets: list[str]) -> list[str]:
    """`host:port` of every engine the targets name now: a `dns:///name:port` entry gives each IPv4 address the
    name resolves to (in sorted order), any other entry stands for itself. OSError naming the target when a name
    does not resolve."""
    addresses: list[str] = []
    for target in targets:
        if not target.startswith("dns:///"):
            addresses.append(target)
            continue
        host, _, port = target.removeprefix("dns:///").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rollout: {target!r} is not dns:///name:port")
        try:
            infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise OSError(f"--rollout: {target!r} does not resolve: {e}") from e
        addresses += [f"{ip}:{port}" for ip in sorted({info[4][0] for info in infos})]
    return list(dict.fromkeys(addresses))


def parse_addresses(value: str | list[str]) -> list[str]:
    """`host:port` addresses from a comma-separated list (or a list); ValueError for an empty one."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    addresses = [p.strip() for p in parts if p.strip()]
    if not addresses:
        raise ValueError("--rollout: at least one rollout engine address (host:port[,host:port...])")
    return addresses


class SharedLauncher(Launcher):
    kind = "shared"
    max_jobs = 1

    def __init__(self, *, rollout: str | list[str], trainer: str, ready_timeout_seconds: float = 300.0,
                 engines_on_demand: LocalLauncher | None = None) -> None:
        """rollout: the standing engines' addresses (comma-separated or a list). ready_timeout_seconds: how long
        `replace` waits for the workers to serve again. engines_on_demand: starts the engines a job asks for beyond
        the standing ones (None: such a job is refused at launch)."""
        if not rollout or not trainer:
            raise ValueError("the shared launcher needs the rollout and trainer addresses (--rollout, --trainer)")
        self.targets, self.trainer = parse_addresses(rollout), trainer
        self.ready_timeout_seconds = ready_timeout_seconds
        self.engines_on_demand = engines_on_demand

    @property
    def rollouts(self) -> list[str]:
        """The standing engines' addresses now (`resolve`)."""
        return resolve(self.targets)

    def launch(self, request: WorkerRequest) -> Workers:
        if request.resources.trainer.replicas > 1:
            raise ValueError(
                f"resources.trainer.replicas: the job asks for {request.resources.trainer.replicas} trainer nodes and "
                "the shared launcher has one standing trainer (--trainer); run the job with the local or kubernetes "
                "launcher, or drop resources.trainer.replicas (the standing trainer's own ranks: its --nnodes and "
                "--nproc-per-node)")
        wanted = request.resources.rollout.replicas
        available = self.rollouts
        standing = available[:wanted]
        extra: list[ManagedProcess] = []
        if wanted > len(standing):
            extra = self._on_demand(request).start_engines(request, range(len(standing), wanted))
            log.info("job %s: %d standing engine(s) and %d started for it", request.job_id, len(standing), len(extra))
        return self._record(standing, extra)

    def alive(self, workers: Workers) -> bool:
        standing = workers.rollouts[:len(workers.rollouts) - len(workers.processes)]
        return (set(standing) <= set(self.rollouts) and workers.trainer == self.trainer
                and all(is_alive(ManagedProcess(**p.model_dump())) for p in workers.processes))

    def stop(self, workers: Workers) -> None:
        """Shared workers outlive every job; the engines started for the job stop with it."""
        if workers.processes and self.engines_on_demand is not None:
            self.engines_on_demand.stop(workers)

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str],
                engines: Collection[str] = ()) -> tuple[Workers, set[str]]:
        """Waits until the standing workers of the job serve again (whoever runs them restarts them; TimeoutError
        after `ready_timeout_seconds`); the engines started for the job that failed (all of them for the role
        'rollout', those at `engines`) or died are started anew, the others keep serving."""
        own = [ManagedProcess(**p.model_dump()) for p in workers.processes]
        standing = workers.rollouts[:len(workers.rollouts) - len(own)]
        for role, address in [*(("rollout", a) for a in standing), ("trainer", self.trainer)]:
            wait_grpc_address(address, self.ready_timeout_seconds, what=f"shared {role}")
        renew = [p for p in own if "rollout" in roles or p.grpc_address in engines or not is_alive(p)]
        if not renew:
            return workers, set()
        started = {p.name: p for p in self._on_demand(request).restart(request, renew)}
        own = [started.get(p.name) or p for p in own]
        return self._record(standing, own), {"rollout"}

    def resize(self, workers: Workers, request: WorkerRequest) -> tuple[Workers, set[str]]:
        """A smaller pool leaves out its last engines (those started for the job stop; standing ones just serve
        other jobs again); a larger one takes the standing engines it did not use, then has the rest started
        (`engines_on_demand`; ValueError without it)."""
        wanted = request.resources.rollout.replicas
        own = [ManagedProcess(**p.model_dump()) for p in workers.processes]
        standing = workers.rollouts[:len(workers.rollouts) - len(own)]
        if wanted <= len(workers.rollouts):
            keep = max(0, wanted - len(standing))
            if own[keep:]:
                self._on_demand(request).stop_engines(own[keep:])
            return self._record(standing[:wanted], own[:keep]), set()
        if not own:
            standing = self.rollouts[:wanted]
        started = []
        if wanted > len(standing) + len(own):
            started = self._on_demand(request).start_more_engines(request, own, wanted - len(standing) - len(own))
        return self._record(standing, [*own, *started]), {"rollout"} if started else set()

    def _on_demand(self, request: WorkerRequest) -> LocalLauncher:
        if self.engines_on_demand is None:
            raise ValueError(
                f"resources.rollout.replicas: the job asks for {request.resources.rollout.replicas} rollout engines "
                f"and the shared launcher has {len(self.rollouts)} (--rollout); give the controller more --rollout "
                "addresses, or --engines-on-demand to start the rest for the job")
        return self.engines_on_demand

    def _record(self, standing: list[str], own: list[ManagedProcess]) -> Workers:
        return Workers(launcher=self.kind, rollouts=[*standing, *(p.grpc_address for p in own)], trainer=self.trainer,
                       dedicated=False, processes=[ProcessHandle(**vars(p)) for p in own])

    def close(self) -> None:
        if self.engines_on_demand is not None:
            self.engines_on_demand.close()
