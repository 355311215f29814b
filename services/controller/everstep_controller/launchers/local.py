"""The local launcher: a job's rollout engines (`resources.rollout.replicas`) and trainer as processes on this machine.

A trainer of N nodes (`resources.trainer.replicas`) is N trainer processes, each a torchrun node of one rank
joined over gloo on loopback through node 0's rendezvous port: the path of a trainer across machines, run on one.

Each runs in its own process group on free loopback ports, with its log under
`<work_dir>/<job id>/`. They outlive a controller killed with SIGKILL, so the controller that
takes the job over re-attaches to them (checked by PID and process start time); a controller
that shuts down cleanly stops them (`everstep down` leaves nothing behind): `close` stops every worker this
launcher started and did not stop, including those of a job whose start was still under way (which its job
thread, left behind, would otherwise finish starting after the controller had stopped the workers it knew).
"""

from __future__ import annotations

import logging
import os
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
from everstep_controller.launchers.base import (
    Launcher,
    ProcessHandle,
    WorkerRequest,
    Workers,
    engine_names,
    node_rank_of,
    trainer_names,
)

log = logging.getLogger(__name__)


def _role(name: str) -> str:
    """'rollout' for every engine of the pool ('rollout', 'rollout-0', ...), 'trainer' for every trainer node."""
    return "rollout" if name.startswith("rollout") else "trainer" if name.startswith("trainer") else name


class LocalLauncher(Launcher):
    kind = "local"

    def __init__(self, *, work_dir: Path, max_jobs: int = 4, threads_per_worker: int = 0,
                 threads_per_engine: int = 0, ready_timeout_seconds: float = 300.0,
                 python: str = sys.executable) -> None:
        """threads_per_worker: torch threads of each worker process (0: their own default).
        threads_per_engine: torch threads of each rollout engine (0: threads_per_worker when set, else, for a pool of
        several engines, this machine's cores divided among them, at least 1 each, so that they share the cores
        instead of fighting over them)."""
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
        if threads_per_worker < 0 or threads_per_engine < 0:
            raise ValueError("threads_per_worker and threads_per_engine: 0 (the default) or more")
        self.work_dir, self.max_jobs = Path(work_dir), max_jobs
        self.threads_per_worker, self.threads_per_engine = threads_per_worker, threads_per_engine
        self.ready_timeout_seconds, self.python = ready_timeout_seconds, python
        self._lock = threading.Lock()
        self._closed = False
        self._started: dict[int, ManagedProcess] = {}  # pid -> every worker started here and not stopped

    def launch(self, request: WorkerRequest) -> Workers:
        for role, wanted in (("rollout", request.resources.rollout), ("trainer", request.resources.trainer)):
            if wanted.model_dump(exclude_none=True, exclude={"replicas"}):
                log.warning("job %s: resources.%s cpu, memory and gpus are ignored by the local launcher (processes "
                            "on this machine)", request.job_id, role)
        return self._workers(self._start(request, self._names(request)))

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str]) -> tuple[Workers, set[str]]:
        """Only the workers of `roles` and the dead ones are started anew: a live trainer keeps its state, and the
        live engines of a pool keep serving. Those of `roles` are killed, not asked to stop: they failed, and a hung
        one would not stop."""
        handles = {p.name: _managed(p) for p in workers.processes}
        names = self._names(request)
        renew = [n for n in names if _role(n) in roles or n not in handles or not is_alive(handles[n])]
        if any(_role(n) == "trainer" for n in renew):  # the nodes of a trainer share one process group
            renew = [n for n in names if n in renew or _role(n) == "trainer"]
        killed = kill_processes(doomed := [handles[n] for n in renew if n in handles])
        self._forget(doomed)
        if killed:
            log.info("job %s: killed %s to start anew", request.job_id, ", ".join(killed))
        started = {p.name: p for p in self._start(request, renew)}
        return self._workers([started.get(n) or handles[n] for n in names]), {_role(n) for n in renew}

    @staticmethod
    def _names(request: WorkerRequest) -> list[str]:
        return [*engine_names(request.resources.rollout.replicas), *trainer_names(request.resources.trainer.replicas)]

    def engine_threads(self, replicas: int) -> int:
        """Torch threads of each engine of a pool of `replicas` (0: the process's own default)."""
        if self.threads_per_engine:
            return self.threads_per_engine
        if self.threads_per_worker or replicas == 1:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // replicas)

    def _start(self, request: WorkerRequest, names: list[str]) -> list[ManagedProcess]:
        """The processes of `names`, each serving gRPC, in that order."""
        engine_threads = self.engine_threads(request.resources.rollout.replicas)
        logs = self.work_dir / request.job_id
        num_nodes = request.resources.trainer.replicas
        master_port = free_port() if num_nodes > 1 and any(_role(n) == "trainer" for n in names) else 0
        started: list[ManagedProcess] = []
        try:
            for name in names:
                role = _role(name)
                threads = engine_threads if role == "rollout" else self.threads_per_worker
                env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
                if role == "rollout":
                    extra_args = ["--max-running", str(request.max_running), "--max-seq-len", str(request.max_seq_len),
                                  "--seed", str(request.seed), *(["--num-threads", str(threads)] if threads else [])]
                elif master_port:
                    extra_args = ["--nnodes", str(num_nodes), "--node-rank", str(node_rank_of(name)),
                                  "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
                else:
                    extra_args = []
                http_port, grpc_port = free_port(), free_port()
                with self._lock:
                    if self._closed:
                        raise RuntimeError(f"job {request.job_id}: the launcher is closed (the controller is "
                                           "stopping); no worker started")
                    process = spawn(name, ["-m", f"everstep_{role}", "--host", "127.0.0.1", "--port", str(http_port),
                                           "--grpc-port", str(grpc_port), *extra_args],
                                    logs / f"{name}.log", executable=self.python, http_port=http_port,
                                    grpc_port=grpc_port, env=env)
                    self._started[process.pid] = process
                started.append(process)
            for process in started:
                if process.name.startswith("trainer-node-"):
                    continue  # followers serve nothing: node 0 serves once every node has joined
                wait_grpc_serving(process, self.ready_timeout_seconds)
        except BaseException:
            self._stop_processes(started)
            raise
        for process in started:
            log.info("job %s: %s pid %d (%s)", request.job_id, process.name, process.pid, process.grpc_address)
        return started

    def start_engines(self, request: WorkerRequest, indices: range) -> list[ManagedProcess]:
        """Engines `rollout-<i>` of the job's pool for each i of `indices`, serving gRPC (the shared launcher's
        engines beyond its standing ones); `stop` and `close` stop them."""
        return self._start(request, [f"rollout-{i}" for i in indices])

    def _workers(self, processes: list[ManagedProcess]) -> Workers:
        trainer = next(p for p in processes if p.name == "trainer")
        engines = [p for p in processes if _role(p.name) == "rollout"]
        return Workers(launcher=self.kind, rollouts=[e.grpc_address for e in engines], trainer=trainer.grpc_address,
                       dedicated=True, processes=[ProcessHandle(**vars(p)) for p in processes])

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
