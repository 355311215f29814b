"""The trackers of one job (the spec's `tracking` section), as the runner uses them: opened when the job's
runner starts, given each committed step's metrics row and each evaluation, closed when the runner ends.

A tracker never fails the job: an error of a backend's library (at open, log or close) is logged and handed to
`on_failure(backend, operation)` (the runner counts it in everstep_controller_tracker_failures_total), and the job
goes on (a backend that failed to open logs nothing more for this runner).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from everstep.rest.job_record import JobState
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep_controller.tracking.backends import (
    MlflowTracker,
    RunIdentity,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
)

__all__ = ["Trackers", "evaluation_values", "step_values"]

log = logging.getLogger(__name__)

_BACKENDS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                               "mlflow": MlflowTracker}


def step_values(row: StepMetrics) -> dict[str, float]:
    """Every field of the metrics row but `step` (the x axis), as REST gives it (trainer stats only when trained); a
    count by kind (tool_errors) as one value per kind, `tool_errors/timeout`."""
    values: dict[str, float] = {}
    for name, value in row.model_dump().items():
        if isinstance(value, dict):
            values.update({f"{name}/{kind}": float(count) for kind, count in value.items()})
        elif name != "step" and value is not None:
            values[name] = float(value)
    return values


def evaluation_values(evaluation: Evaluation) -> dict[str, float]:
    """The evaluation's fields but `step`, as eval/<field>; an accuracy that is null is left out."""
    return {f"eval/{name}": float(value) for name, value in evaluation.model_dump().items()
            if name != "step" and value is not None}


class Trackers:
    """Thread-safe: a job's steps may commit on its trainer thread while evaluations run on its runner thread."""

    def __init__(self, job_id: str, spec: JobSpec, *,
                 on_failure: Callable[[str, str], None] = lambda backend, operation: None) -> None:
        """on_failure(backend, operation): called for each failed call, after it is logged."""
        self.job_id, self.spec, self.on_failure = job_id, spec, on_failure
        self._open: dict[str, Tracker] = {}
        self._last_step = 0  # the latest step logged (by this runner, or committed before it started)
        self._lock = threading.Lock()

    def open(self, *, resumed_after_step: int | None) -> None:
        """Starts (or resumes) a run in each backend the spec names."""
        self._last_step = max(self._last_step, resumed_after_step or 0)
        run = RunIdentity(job_id=self.job_id, run_name=f"{self.spec.name}-{self.job_id}",
                          spec=self.spec.model_dump(mode="json"), resumed_after_step=resumed_after_step)
        for backend, make in _BACKENDS.items():
            settings = getattr(self.spec.tracking, backend)
            if settings is None or backend in self._open:
                continue
            try:
                tracker = make(settings, run)
            except Exception as e:  # noqa: BLE001 (any library error: the job goes on without this backend)
                self._failed(backend, "open", e)
                continue
            with self._lock:
                self._open[backend] = tracker
            log.info("job %s: tracking to %s", self.job_id, backend)

    def log_step(self, row: StepMetrics) -> None:
        self._last_step = max(self._last_step, row.step)
        self._each("log_step", lambda tracker: tracker.log(row.step, step_values(row)))

    def continue_after(self, step: int) -> None:
        """The job continues after `step`; when that is before a step already logged (the job went back to a
        checkpoint), each backend is told (`Tracker.rewind`)."""
        if step < self._last_step:
            log.info("job %s: tracking goes back from step %d to %d", self.job_id, self._last_step, step)
            self._each("rewind", lambda tracker: tracker.rewind(step))
            self._last_step = step

    def log_evaluation(self, evaluation: Evaluation) -> None:
        self._each("log_evaluation", lambda tracker: tracker.log(evaluation.step, evaluation_values(evaluation)))

    def close(self, state: JobState | None) -> None:
        """state: the terminal state stored, or None when the runner stopped without ending the job."""
        self._each("close", lambda tracker: tracker.close(state))
        with self._lock:
            self._open.clear()

    def _each(self, operation: str, call: Callable[[Tracker], None]) -> None:
        with self._lock:
            for backend, tracker in self._open.items():
                try:
                    call(tracker)
                except Exception as e:  # noqa: BLE001 (a tracker never fails the job)
                    self._failed(backend, operation, e)

    def _failed(self, backend: str, operation: str, error: Exception) -> None:
        log.warning("job %s: tracking to %s failed at %s (the job goes on): %s: %s", self.job_id, backend,
                    operation, type(error).__name__, error, exc_info=log.isEnabledFor(logging.DEBUG))
        self.on_failure(backend, operation)
