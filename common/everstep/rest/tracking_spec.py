"""The job spec's `tracking` section: where a job's curves go besides its REST history and Prometheus.

Each backend is logged through its own library (tensorboardX, wandb, mlflow), an optional extra of the
controller (`pip install 'everstep-controller[tracking]'`, or one extra per backend). A job that names a
backend whose library the controller lacks is refused at submission (422 naming the field and the extra).
docs/tracking.md maps these fields to verl's `trainer.logger` and TRL's `report_to`.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from everstep.settings.training import Section as _Section

__all__ = ["MlflowTracking", "TensorBoardTracking", "TrackingSpec", "WandbMode", "WandbTracking"]


class TensorBoardTracking(_Section):
    """TensorBoard event files (written with tensorboardX)."""

    log_dir: str = Field(
        min_length=1,
        description="Folder of the job's event files (created if missing; one job per folder: point TensorBoard "
                    "at the parent folder to compare jobs). A resumed job appends to it.")


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"


class WandbTracking(_Section):
    """A Weights & Biases run (the wandb library).

    WANDB_API_KEY, WANDB_DIR and the other WANDB_* variables of the controller's environment apply."""

    project: str = Field(min_length=1, description="W&B project.")
    entity: str | None = Field(default=None, min_length=1, description="W&B entity (user or team); none: the "
                                                                        "API key's default.")
    run_name: str | None = Field(default=None, min_length=1,
                                 description="Display name of the run; none: '<name>-<job id>'.")
    mode: WandbMode = Field(
        default=WandbMode.offline,
        description="'offline': the run is written under WANDB_DIR only (upload it later with `wandb sync`); "
                    "'online': streamed to the W&B server (needs WANDB_API_KEY in the controller's environment).")


class MlflowTracking(_Section):
    """An MLflow run (the mlflow client library)."""

    tracking_uri: str = Field(
        min_length=1, description="MLflow tracking URI: a server (http://host:5000), or a local store: "
                                  "'file:///path/mlruns' (recent MLflow keeps it only with "
                                  "MLFLOW_ALLOW_FILE_STORE=true in the controller's environment) or "
                                  "'sqlite:///mlflow.db' (needs the full mlflow package, not the extra's "
                                  "mlflow-skinny).")
    experiment_name: str = Field(default="everstep", min_length=1,
                                 description="Experiment of the run (created if missing).")
    run_name: str | None = Field(default=None, min_length=1,
                                 description="Display name of the run; none: '<name>-<job id>'.")


class TrackingSpec(_Section):
    """Experiment tracking: any combination of TensorBoard, W&B and MLflow (none by default; docs/tracking.md).

    Every field of each step's metrics row (`GET /v1/jobs/{id}/metrics`, same names, at its step), every evaluation
    (eval/accuracy, eval/greedy_accuracy, ... at its step) and the job spec (hparams text, W&B config, MLflow
    params) are logged. A tracker that fails is logged and counted
    (everstep_controller_tracker_failures_total) and the job goes on."""

    tensorboard: TensorBoardTracking | None = Field(default=None, description="TensorBoard event files; none: off.")
    wandb: WandbTracking | None = Field(default=None, description="A Weights & Biases run; none: off.")
    mlflow: MlflowTracking | None = Field(default=None, description="An MLflow run; none: off.")
