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
from collections.abc import Collection
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
    more_engine_names,
    node_rank_of,
    role_of,
    worker_names,
)

log = logging.getLogger(__name__)


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
        return self._workers(self._start(request, worker_names(request)))

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str],
                engines: Collection[str] = ()) -> tuple[Workers, set[str]]:
        """Only the workers of `roles`, the engines at `engines` and the dead ones are started anew (under the same
        names, on new ports): a live trainer keeps its state, and the other engines of a pool keep serving. Those
        named are killed, not asked to stop: they failed, and a hung one would not stop."""
        handles = [_managed(p) for p in workers.processes]
        renew = [h for h in handles if role_of(h.name) in roles or h.grpc_address in engines or not is_alive(h)]
        if any(role_of(h.name) == "trainer" for h in renew):  # the nodes of a trainer share one process group
            renew = [h for h in handles if h in renew or role_of(h.name) == "trainer"]
        started = {p.name: p for p in self.restart(request, renew)}
        return self._workers([started.get(h.name) or h for h in handles]), {role_of(h.name) for h in renew}

    def restart(self, request: WorkerRequest, processes: list[ManagedProcess]) -> list[ManagedProcess]:
        """Kills `processes` (failed ones: a hung one would not stop when asked) and starts each anew under its
        name, on new ports, serving gRPC."""
        killed = kill_processes(processes)
        self._forget(processes)
        if killed:
            log.info("job %s: killed %s to start anew", request.job_id, ", ".join(killed))
        return self._start(request, [p.name for p in processes])

    def resize(self, workers: Workers, request: WorkerRequest) -> tuple[Workers, set[str]]:
        """Engines beyond `request.resources.rollout.replicas` stop (the last ones of the pool); missing ones start
        under names the pool does not use yet (`rollout-<i>`), with the threads of a pool of the new size; the rest,
        and the trainer, keep running."""
        handles = [_managed(p) for p in workers.processes]
        engines = [h for h in handles if role_of(h.name) == "rollout"]
        trainer = [h for h in handles if role_of(h.name) != "rollout"]
        wanted = request.resources.rollout.replicas
        if wanted < len(engines):
            stopped = self._stop_processes(engines[wanted:])
            log.info("job %s: pool of %d engine(s): stopped %s", request.job_id, wanted, ", ".join(stopped))
            return self._workers([*engines[:wanted], *trainer]), set()
        started = self.start_more_engines(request, engines, wanted - len(engines))
        return self._workers([*engines, *started, *trainer]), {"rollout"} if started else set()

    def start_more_engines(self, request: WorkerRequest, engines: list[ManagedProcess],
                           count: int) -> list[ManagedProcess]:
        """`count` engines more for a pool that has `engines` (named by `more_engine_names`), serving gRPC."""
        return self._start(request, more_engine_names([e.name for e in engines], count))

    def stop_engines(self, processes: list[ManagedProcess]) -> None:
        """Stops engines of a pool that shrank (asked to stop first: they were drained)."""
        stopped = self._stop_processes(processes)
        if stopped:
            log.info("stopped %s (pids %s)", ", ".join(stopped), [p.pid for p in processes])

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
        master_port = free_port() if num_nodes > 1 and any(role_of(n) == "trainer" for n in names) else 0
        started: list[ManagedProcess] = []
        try:
            for name in names:
                role = role_of(name)
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
        engines = [p for p in processes if role_of(p.name) == "rollout"]
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
