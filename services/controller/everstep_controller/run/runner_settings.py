"""Settings every job runner of a controller shares (the controller's command-line options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import Deadlines
from everstep_controller.settings import ControllerSettings, check_settings, from_settings, setting

__all__ = ["RunnerSettings"]


@dataclass(frozen=True, kw_only=True)
class RunnerSettings:
    """Each field's default, check and meaning: the controller option it names (`ControllerSettings`)."""

    num_scorers: int = setting("num_scorers")
    """Scorer threads per job (concurrent reward calls)."""
    scoring_timeout_seconds: float = setting("scoring_timeout_seconds")
    score_attempts: int = setting("score_attempts")
    worker_restarts: int = setting("worker_restarts")
    """Also the retried calls allowed without a completed step."""
    sandbox: str = setting("sandbox")
    """Where the python tool runs (ToolConfig.sandbox_address)."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """Of every gRPC call."""
    backoff: Backoff = field(default_factory=Backoff)
    """Pauses before a retried reward call and before a worker restart."""

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_settings(cls, settings: ControllerSettings) -> RunnerSettings:
        return from_settings(cls, settings, deadlines=Deadlines.from_settings(settings),
                             backoff=Backoff.from_settings(settings))
