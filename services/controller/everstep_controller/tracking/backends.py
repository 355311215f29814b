"""One tracker per backend, each through its own library (imported here only when a job names the backend).

Every tracker logs `log(step, values)` at `step` and ends its run with `close(state)`. Values are
floats keyed by the REST names (a metrics row's fields; `eval/<field>` for an evaluation). TensorBoard
stores scalars as float32 (`simple_value`); W&B and MLflow keep float64.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from everstep.rest.job_record import JobState
from everstep.rest.tracking_spec import MlflowTracking, TensorBoardTracking, WandbTracking

__all__ = ["MLFLOW_JOB_TAG", "MlflowTracker", "RunIdentity", "TensorBoardTracker", "Tracker", "WandbTracker",
           "wandb_run_id"]

MLFLOW_JOB_TAG = "everstep.job_id"
"""The tag by which a resumed job finds its MLflow run."""


@dataclass(frozen=True, kw_only=True)
class RunIdentity:
    """Which job a run is, and where it starts."""

    job_id: str
    run_name: str
    spec: dict[str, Any]
    """The job spec as JSON."""
    resumed_after_step: int | None
    """None: the job starts now; else it continues after this committed step (a controller restart or takeover)."""


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def rewind(self, step: int) -> None:
        """The job went back to `step` (a checkpoint, after a worker failed): the later steps are logged again."""

    def close(self, state: JobState | None) -> None:
        """state: the job's terminal state, or None when this runner stopped without ending the job."""


def wandb_run_id(job_id: str) -> str:
    """The W&B run id of a job: the same after a restart, so the run is resumed rather than a new one made."""
    return f"everstep-{job_id}"


class TensorBoardTracker:
    """Event files in `log_dir` (tensorboardX). A resumed job appends a new event file there; it starts with a
    purge marker at the step it continues from, so TensorBoard drops any value logged past it before."""

    def __init__(self, settings: TensorBoardTracking, run: RunIdentity) -> None:
        self.log_dir = settings.log_dir
        self.writer = self._writer(None if run.resumed_after_step is None else run.resumed_after_step + 1)
        if run.resumed_after_step is None:
            text = json.dumps(run.spec, indent=2)
            self.writer.add_text("job_spec", f"job {run.job_id} ({run.run_name})\n\n```json\n{text}\n```", 0)
            self.writer.flush()

    def _writer(self, purge_step: int | None):  # noqa: ANN202 (tensorboardX is imported here only)
        from tensorboardX import SummaryWriter

        # tensorboardX names a file by the second and the host only, and opens it with "wb": a second writer in
        # the same second would erase the first's file. The nanosecond suffix keeps each file, in order.
        return SummaryWriter(logdir=self.log_dir, purge_step=purge_step, flush_secs=30,
                             filename_suffix=f".{time.time_ns()}")

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        self.writer.close()
        self.writer = self._writer(step + 1)  # a new event file whose purge marker drops the steps redone

    def close(self, state: JobState | None) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run with id `everstep-<job id>`, resumed (`resume="allow"`) after a restart. Offline, a resumed job
    writes a second run folder with the same run id under WANDB_DIR (`wandb sync` uploads both to that run)."""

    def __init__(self, settings: WandbTracking, run: RunIdentity) -> None:
        import wandb

        # console "off": the controller's own stdout is not captured; no system stats: one process, many jobs
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.run_name or run.run_name,
                              id=wandb_run_id(run.job_id), resume="allow", mode=settings.mode.value, config=run.spec,
                              reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def rewind(self, step: int) -> None:
        pass  # W&B's steps only increase: it drops (and warns of) values logged below its last step

    def close(self, state: JobState | None) -> None:
        self.run.summary["everstep_state"] = state.value if state is not None else "RUNNING"
        self.run.finish(exit_code=1 if state == JobState.FAILED else 0)


_MLFLOW_STATUS = {JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED", JobState.CANCELLED: "KILLED"}
_MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a param's value
_MLFLOW_BATCH = 100  # params per log_batch call


class MlflowTracker:
    """An MLflow run tagged `everstep.job_id`; a resumed job finds it by that tag and logs into it again.

    Through `MlflowClient` (not the fluent `mlflow.start_run`, whose active run is per thread: a job's steps
    may commit on its trainer thread). The spec is logged as params (dotted paths, lists as JSON) and as the
    artifact job_spec.json."""

    def __init__(self, settings: MlflowTracking, run: RunIdentity) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        experiment = self.client.get_experiment_by_name(settings.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(settings.experiment_name)
            except MlflowException:  # another job created it meanwhile
                experiment_id = self.client.get_experiment_by_name(settings.experiment_name).experiment_id
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_JOB_TAG}` = '{run.job_id}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        created = self.client.create_run(experiment_id, run_name=settings.run_name or run.run_name,
                                         tags={MLFLOW_JOB_TAG: run.job_id})
        self.run_id = created.info.run_id
        self._log_spec(run.spec)

    def _log_spec(self, spec: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value[:_MLFLOW_PARAM_CHARS]) for key, value in _flatten(spec).items()]
        for start in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + _MLFLOW_BATCH])
        self.client.log_text(self.run_id, json.dumps(spec, indent=2), "job_spec.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id,
                              metrics=[Metric(name, value, now_ms, step) for name, value in values.items()])

    def rewind(self, step: int) -> None:
        pass  # a step logged again is a second value at that step in the metric's history

    def close(self, state: JobState | None) -> None:
        if state is not None:  # else the run stays RUNNING for the controller that continues the job
            self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[state])


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:  # noqa: ANN401 (any JSON value)
    """{"a": {"b": 1}} -> {"a.b": "1"}; a list or null becomes its JSON."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    text = value if isinstance(value, str) else json.dumps(value)
    return {prefix.rstrip("."): text}
