"""Experiment tracking: a job's metrics rows, evaluations and spec logged to TensorBoard, W&B and MLflow
(the spec's `tracking` section) through each one's own library, imported only when a job names it."""

from everstep_controller.tracking.trackers import Trackers

__all__ = ["Trackers"]
