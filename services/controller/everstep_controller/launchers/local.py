"""The local launcher: a job's rollout engine and trainer as two processes on this machine.

Each runs in its own process group on free loopback ports, with its log under
`<work_dir>/<job id>/`. They outlive a controller killed with SIGKILL, so the controller that
takes the job over re-attaches to them (checked by PID and process start time); a controller
that shuts down cleanly stops them (`everstep down` leaves nothing behind): `close` stops every worker this
launcher started and did not stop, including those of a job whose start was still under way (which its job
thread, left behind, would otherwise finish starting after the controller had stopped the workers it knew).
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from everstep.processes import (
    ManagedProcess,
    free_port,
    is_alive,
    kill_processes,
    spawn,
    stop_processes,
    wait_grpc_serving,
)
from everstep_controller.launchers.base import Launcher, ProcessHandle, WorkerRequest, Workers

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
        self._lock = threading.Lock()
        self._closed = False
        self._started: dict[int, ManagedProcess] = {}  # pid -> every worker started here and not stopped

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
        killed = kill_processes(doomed := [handles[r] for r in renew if r in handles])
        self._forget(doomed)
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
                with self._lock:
                    if self._closed:
                        raise RuntimeError(f"job {request.job_id}: the launcher is closed (the controller is "
                                           "stopping); no worker started")
                    process = spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                                           "--grpc-port", str(grpc_port), *extra_args[name]],
                                    logs / f"{name}.log", executable=self.python, http_port=http_port,
                                    grpc_port=grpc_port, env=env)
                    self._started[process.pid] = process
                started.append(process)
            for process in started:
                wait_grpc_serving(process, self.ready_timeout_seconds)
        except BaseException:
            self._stop_processes(started)
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
        stopped = self._stop_processes([_managed(p) for p in workers.processes])
        if stopped:
            log.info("stopped %s (pids %s)", ", ".join(stopped), [p.pid for p in workers.processes])

    def close(self) -> None:
        """Stops every worker started here and not stopped since; no worker starts after it."""
        with self._lock:
            self._closed = True
            left = list(self._started.values())
        stopped = self._stop_processes(left)
        if stopped:
            log.info("closing: stopped %s (pids %s)", ", ".join(stopped), [p.pid for p in left])

    def _stop_processes(self, processes: list[ManagedProcess]) -> list[str]:
        stopped = stop_processes(processes)
        self._forget(processes)
        return stopped

    def _forget(self, processes: list[ManagedProcess]) -> None:
        with self._lock:
            for process in processes:
                self._started.pop(process.pid, None)


def _managed(handle: ProcessHandle) -> ManagedProcess:
    return ManagedProcess(**handle.model_dump())
