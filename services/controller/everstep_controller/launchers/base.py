"""The launcher interface and the records it exchanges with the runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection

from pydantic import BaseModel, Field

from everstep.rest.job_spec import ResourcesSpec


class WorkerRequest(BaseModel):
    """What one job needs from its workers."""

    job_id: str
    max_running: int = Field(ge=1, description="Sequences the engine decodes together (the pool size).")
    max_seq_len: int = Field(ge=2, description="Prompt plus output tokens of the longest sequence.")
    seed: int = 0
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)


class ProcessHandle(BaseModel):
    """A local worker process (see `processes.ManagedProcess`)."""

    name: str
    pid: int
    start_ticks: int
    log_path: str
    http_port: int
    grpc_port: int


class ObjectHandle(BaseModel):
    """A Kubernetes object a launcher created."""

    kind: str
    name: str
    namespace: str
    uid: str = Field(default="", description="Pods: the uid the launch saw.")
    restarts: int = Field(default=0, description="Pods: container restarts when the launch saw it.")
    worker: str = Field(default="", description="Pods: the worker it runs ('rollout-1', 'trainer', ...); empty in "
                                                "records written before it was kept.")


def engine_names(replicas: int) -> list[str]:
    """The worker names of a pool of `replicas` rollout engines: 'rollout' alone, else 'rollout-0', 'rollout-1', ..."""
    return ["rollout"] if replicas == 1 else [f"rollout-{i}" for i in range(replicas)]


def more_engine_names(used: Collection[str], count: int) -> list[str]:
    """The worker names of `count` engines added to a pool whose engines are named `used`: `rollout-<i>` with the
    first i the pool does not use (a pool of one, 'rollout', grows with 'rollout-0', 'rollout-1', ...)."""
    taken = set(used)
    return [n for n in (f"rollout-{i}" for i in range(count + len(taken))) if n not in taken][:count]


def trainer_names(replicas: int) -> list[str]:
    """The worker names of a trainer of `replicas` nodes: 'trainer' (node 0, which serves gRPC), then
    'trainer-node-1', 'trainer-node-2', ... (they follow node 0 and serve nothing)."""
    return ["trainer", *(f"trainer-node-{k}" for k in range(1, replicas))]


def worker_names(request: WorkerRequest) -> list[str]:
    """The job's workers: its engines (`engine_names`), then the trainer's nodes (`trainer_names`)."""
    return [*engine_names(request.resources.rollout.replicas), *trainer_names(request.resources.trainer.replicas)]


def role_of(worker: str) -> str:
    """The role of a worker name: 'rollout' for every engine of the pool ('rollout', 'rollout-0', ...), 'trainer'
    for every trainer node ('trainer', 'trainer-node-1', ...)."""
    return "rollout" if worker.startswith("rollout") else "trainer" if worker.startswith("trainer") else worker


def node_rank_of(worker: str) -> int:
    """The node index of a trainer worker name (`trainer_names`)."""
    return 0 if worker == "trainer" else int(worker.removeprefix("trainer-node-"))


class Workers(BaseModel):
    """A job's workers: their gRPC addresses and how to find them again."""

    launcher: str
    rollouts: list[str] = Field(min_length=1, description="gRPC host:port of each rollout engine of the job's pool.")
    trainer: str = Field(description="gRPC host:port of the trainer.")
    dedicated: bool = Field(description="True when no other job uses these workers.")
    processes: list[ProcessHandle] = Field(default_factory=list)
    objects: list[ObjectHandle] = Field(default_factory=list)


class Launcher(ABC):
    kind: str
    max_jobs: int | None
    """Jobs it can run at once; None: no limit of its own."""

    @abstractmethod
    def launch(self, request: WorkerRequest) -> Workers:
        """Starts the job's workers and returns once both serve gRPC."""

    @abstractmethod
    def alive(self, workers: Workers) -> bool:
        """Whether every worker of the record is still running (the same process or pod)."""

    @abstractmethod
    def stop(self, workers: Workers) -> None:
        """Stops the workers of the record (nothing for ones already gone)."""

    @abstractmethod
    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str],
                engines: Collection[str] = ()) -> tuple[Workers, set[str]]:
        """Starts anew the workers of `roles` ('rollout': every engine of the pool, 'trainer': e.g. one that hung),
        the engines at the addresses `engines` (one that failed) and any worker that is not running; returns the
        new record and the roles of the workers started anew (empty: none was).

        Only those: a trainer that is fine keeps its state when only a rollout engine died, and the other engines of
        the pool keep theirs. The nodes of a trainer share one process group, so one node started anew starts them
        all anew.
        """

    @abstractmethod
    def resize(self, workers: Workers, request: WorkerRequest) -> tuple[Workers, set[str]]:
        """The pool brought to `request.resources.rollout.replicas` engines (a running job scaled): the last engines
        of the pool stopped, or engines added (`more_engine_names`), the rest and the trainer kept; returns the new
        record and the roles of the workers started anew ({'rollout'} when engines were added)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most launchers keep nothing)
        """Stops whatever this launcher keeps for itself (clients, threads)."""
