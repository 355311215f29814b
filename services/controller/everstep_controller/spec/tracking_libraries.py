"""Which library each backend of the spec's `tracking` section needs, and the check that it is installed (the
422 at submission: `spec.submission_checks`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from everstep.rest.tracking_spec import TrackingSpec

__all__ = ["BACKEND_LIBRARIES", "BackendLibrary", "MissingTrackingLibrary", "check_tracking_libraries",
           "library_installed"]


@dataclass(frozen=True)
class BackendLibrary:
    module: str
    """What the tracker imports."""
    extra: str
    """The controller's pip extra that installs it."""


BACKEND_LIBRARIES: dict[str, BackendLibrary] = {
    "tensorboard": BackendLibrary("tensorboardX", "tensorboard"),
    "wandb": BackendLibrary("wandb", "wandb"),
    "mlflow": BackendLibrary("mlflow", "mlflow"),
}
"""tracking.<backend> -> its library; the keys are TrackingSpec's fields."""


class MissingTrackingLibrary(ValueError):
    """A backend the spec names whose library this controller lacks; `field` is the spec's, e.g. 'wandb'."""

    def __init__(self, field: str, library: BackendLibrary) -> None:
        super().__init__(f"tracking.{field} needs the {library.module} library, which this controller lacks: "
                         f"pip install 'everstep-controller[{library.extra}]' (or [tracking] for every backend)")
        self.field = field


def library_installed(module: str) -> bool:
    """The import check: whether `module` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def check_tracking_libraries(spec: TrackingSpec) -> None:
    """MissingTrackingLibrary for the first backend set in `spec` whose library is not installed."""
    for field, library in BACKEND_LIBRARIES.items():
        if getattr(spec, field) is not None and not library_installed(library.module):
            raise MissingTrackingLibrary(field, library)
