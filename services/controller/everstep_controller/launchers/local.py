"""The local launcher: a job's rollout engine and trainer as two processes on this machine.

Each runs in its own process group on free loopback ports, with its log under
`<work_dir>/<job id>/`. They outlive a controller killed with SIGKILL, so the controller that
takes the job over re-attaches to them (checked by PID and process start time); a controller
that shuts down cleanly stops them (`everstep down` leaves nothing behind).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from everstep_controller.launchers.base import Launcher, ProcessHandle, WorkerRequest, Workers
from everstep_controller.launchers.processes import (
    ManagedProcess,
    free_port,
    is_alive,
    kill_processes,
    spawn,
    stop_processes,
    wait_grpc_serving,
)

log = logging.getLogger(__name__)

ROLES = ("rollout", "trainer")


class LocalLauncher(Launcher):
    kind = "local"

    def __init__(self, *, work_dir: Path, max_jobs: int = 4, threads_per_worker: int = 0,
                 ready_timeout_seconds: float = 300.0, python: str = sys.executable) -> None:
        """threads_per_worker: torch threads of each worker process (0: their own default)."""
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
        self.work_dir, self.max_jobs = Path(work_dir), max_jobs
        self.threads_per_worker, self.ready_timeout_seconds, self.python = (
            threads_per_worker, ready_timeout_seconds, python)

    def launch(self, request: WorkerRequest) -> Workers:
        for role, wanted in (("rollout", request.resources.rollout), ("trainer", request.resources.trainer)):
            if wanted.model_dump(exclude_none=True):
                log.warning("job %s: resources.%s is ignored by the local launcher (processes on this machine)",
                            request.job_id, role)
        return self._workers(self._start(request, ROLES))

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str]) -> tuple[Workers, set[str]]:
        """Only the workers of `roles` and the dead ones are started anew: a live trainer keeps its state.
        Those of `roles` are killed, not asked to stop: they failed, and a hung one would not stop."""
        handles = {p.name: _managed(p) for p in workers.processes}
        renew = {r for r in ROLES if r in roles or r not in handles or not is_alive(handles[r])}
        killed = kill_processes([handles[r] for r in renew if r in handles])
        if killed:
            log.info("job %s: killed %s to start anew", request.job_id, ", ".join(killed))
        started = {p.name: p for p in self._start(request, [r for r in ROLES if r in renew])}
        return self._workers([started.get(r) or handles[r] for r in ROLES]), renew

    def _start(self, request: WorkerRequest, roles: list[str] | tuple[str, ...]) -> list[ManagedProcess]:
        """The processes of `roles`, each serving gRPC, in that order."""
        env = {"OMP_NUM_THREADS": str(self.threads_per_worker)} if self.threads_per_worker else {}
        threads = ["--num-threads", str(self.threads_per_worker)] if self.threads_per_worker else []
        extra_args = {"rollout": ["--max-running", str(request.max_running), "--max-seq-len", str(request.max_seq_len),
                                  "--seed", str(request.seed), *threads],
                      "trainer": []}
        logs = self.work_dir / request.job_id
        started: list[ManagedProcess] = []
        try:
            for name in roles:
                http_port, grpc_port = free_port(), free_port()
                started.append(spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                                            "--grpc-port", str(grpc_port), *extra_args[name]],
                                     logs / f"{name}.log", executable=self.python, http_port=http_port,
                                     grpc_port=grpc_port, env=env))
            for process in started:
                wait_grpc_serving(process, self.ready_timeout_seconds)
        except BaseException:
            stop_processes(started)
            raise
        for process in started:
            log.info("job %s: %s pid %d (%s)", request.job_id, process.name, process.pid, process.grpc_address)
        return started

    def _workers(self, processes: list[ManagedProcess]) -> Workers:
        rollout, trainer = processes
        return Workers(launcher=self.kind, rollout=rollout.grpc_address, trainer=trainer.grpc_address, dedicated=True,
                       processes=[ProcessHandle(**vars(p)) for p in processes])

    def alive(self, workers: Workers) -> bool:
        return bool(workers.processes) and all(is_alive(_managed(p)) for p in workers.processes)

    def stop(self, workers: Workers) -> None:
        stopped = stop_processes([_managed(p) for p in workers.processes])
        if stopped:
            log.info("stopped %s (pids %s)", ", ".join(stopped), [p.pid for p in workers.processes])


def _managed(handle: ProcessHandle) -> ManagedProcess:
    return ManagedProcess(**handle.model_dump())
