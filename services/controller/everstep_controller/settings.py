"""The controller's own options (`python -m everstep_controller --help`): each one's default, check and
description are written once, here, in `ControllerSettings`.

`__main__` generates its flags from these fields (`--lease-seconds` for `lease_seconds`). The settings
objects the rest of the controller passes around (the runners' `RunnerSettings`, the clients' `Deadlines`,
the retries' `Backoff`) hold some of these options: they name each with `setting("option")`, which gives
their field the option's default and its check, so that nothing is repeated.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["ControllerSettings", "Option", "SettingError", "check_backoff", "check_settings", "from_settings",
           "setting"]

_T = TypeVar("_T")


class SettingError(ValueError):
    """An option's value is out of range; `name` is the field (of whichever settings object) it was given as."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name} {message}")
        self.name = name
        self.message = message


def _at_least(low: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        if value >= low:
            return None
        return f"must be >= 0, got {value}" if low == 0 else f"must be at least {low}, got {value}"

    return check


def _positive(value: float) -> str | None:
    return None if value > 0 else f"must be positive, got {value}"


@dataclass(frozen=True, kw_only=True)
class Option:
    """What a field of `ControllerSettings` says besides its default: its flag's help, check and source."""

    help: str
    check: Callable[[Any], str | None] | None = None
    """The value -> None if it is fine, else what is wrong (after the field's name: 'must be ...')."""
    group: str | None = None
    """The flag's argparse group ('rest': REST security), None: the main list."""
    env: str | None = None
    """An environment variable that gives the flag's default when it is set."""
    choices: tuple[str, ...] | None = None


def _option(default: Any = dataclasses.MISSING, **meta: Any) -> Any:  # noqa: ANN401 (any option's type)
    return field(default=default, metadata={"option": Option(**meta)})


@dataclass(frozen=True, kw_only=True)
class ControllerSettings:
    """Every option of the controller service, in the order of its flags."""

    host: str = _option("127.0.0.1", help="REST address to listen on")
    port: int = _option(8000, help="REST port")
    grpc_port: int = _option(0, help="unused: the controller serves REST only")
    redis_url: str = _option(env="EVERSTEP_REDIS_URL",
                             help="redis://host:port/db holding all job state (a password in it: prefer the "
                                  "environment variable, which no process listing shows)")
    reward: str = _option(help="reward service gRPC target (a shared pool): host:port or dns:///host:port (every "
                               "address the name resolves to, e.g. a headless Service) or ipv4:a:p,b:p; calls go "
                               "round robin over the addresses")
    sandbox: str = _option("", help="sandbox gRPC target (host:port, dns:///host:port or ipv4:a:p,b:p; calls go round "
                                    "robin over its addresses), where the python tool of jobs with "
                                    "tools.environment 'python' runs code ('': the rollout engine's "
                                    "--sandbox-endpoint)")
    launcher: str | None = _option(
        None, choices=("local", "kubernetes", "shared"),
        help="who gives each job its rollout engine and trainer: 'local' processes, 'kubernetes' workloads, or the "
             "'shared' ones at --rollout/--trainer (one job at a time). Default: shared when --rollout and "
             "--trainer are given, else local")
    rollout: str | None = _option(
        None, help="the standing rollout engines' gRPC addresses, host:port[,host:port...] (launcher shared); a job "
                   "with resources.rollout.replicas N uses the first N")
    engines_on_demand: str = _option(
        "none", choices=("none", "local"),
        help="launcher shared: 'local' starts the rollout engines a job asks for beyond the --rollout ones as local "
             "processes of the job, stopped with it (everstep up); 'none' refuses such a job at launch")
    trainer: str | None = _option(None, help="shared trainer gRPC address (launcher shared)")
    max_jobs: int | None = _option(
        None, help="jobs run at once (default: 1 with shared workers, 4 with local ones, 16 on Kubernetes)")
    lease_seconds: float = _option(
        30.0, help="a job whose controller has not renewed its lease this long is taken over")
    num_scorers: int = _option(2, check=_at_least(1), help="threads per job sending rollouts to the reward service")
    rollout_deadline_seconds: float = _option(
        120.0, check=_positive, help="deadline of a unary call to a rollout engine (Load, GetStatus, Drain)")
    generate_deadline_seconds: float = _option(
        3600.0, check=_positive, help="deadline of one Generate stream: one iteration's rollouts, or one evaluation")
    engine_probe_seconds: float = _option(
        10.0, check=_at_least(0),
        help="while a rollout engine has rollouts of the job out, its gRPC health service is asked this often; an "
             "engine that fails --engine-probe-failures checks in a row is taken for hung and leaves the pool (its "
             "rollouts go on the other engines) long before --generate-deadline-seconds (0: no probe)")
    engine_probe_timeout_seconds: float = _option(
        10.0, check=_positive, help="deadline of one health check of a rollout engine (--engine-probe-seconds)")
    engine_probe_failures: int = _option(
        3, check=_at_least(1), help="health checks failed in a row that make a rollout engine taken for hung")
    trainer_deadline_seconds: float = _option(
        600.0, check=_positive, help="deadline of a call to a trainer (Load, TrainStep, PushWeights, checkpoints)")
    reward_deadline_seconds: float = _option(300.0, check=_positive,
                                             help="deadline of one Score call to the reward service")
    worker_restarts: int = _option(
        3, check=_at_least(0),
        help="restarts of a job's failed workers (killed, hung past a deadline) allowed without a completed step in "
             "between; then the job fails with the last error")
    score_attempts: int = _option(
        8, check=_at_least(1),
        help="reward calls per sample while its reward has a transient error (sandbox down, timeout)")
    scoring_timeout_seconds: float = _option(
        600.0, check=_positive,
        help="how long a step waits for its rewards (reward service down or hung); then the job fails")
    retry_initial_seconds: float = _option(
        0.5, check=_positive,
        help="pause before the first retry of a reward call or worker restart; it doubles per failure")
    retry_max_seconds: float = _option(30.0, check=_positive, help="longest pause between retries")
    redis_retry_seconds: float = _option(
        30.0, check=_at_least(0),
        help="how long a Redis command is retried while Redis is unreachable (e.g. restarting)")
    finished_job_series_seconds: float = _option(
        300.0, check=_at_least(0),
        help="how long a job's Prometheus series (those labelled job_id) stay on /metrics after it ended here: a few "
             "scrape intervals, so that the final values are scraped (0: removed at once)")
    threads_per_worker: int = _option(
        0, check=_at_least(0), help="local launcher: torch threads of each worker process (0: their default)")
    threads_per_engine: int = _option(
        0, check=_at_least(0),
        help="local launcher: torch threads of each rollout engine (0: --threads-per-worker when set, else for a pool "
             "of N engines this machine's cores divided by N, at least 1, so that the engines share the cores)")
    k8s_namespace: str | None = _option(
        None, help="kubernetes launcher: namespace of the workloads (default: the controller pod's own)")
    k8s_template_prefix: str = _option(
        "everstep", help="kubernetes launcher: the chart's fullname; PodTemplates <prefix>-rollout, <prefix>-trainer")
    data_dir: str = _option(
        ".everstep/data", help="checkpoints of jobs without checkpoint.dir, and local workers' logs")
    log_level: str = _option("INFO", help="logging level")
    rest_tls_cert: str | None = _option(
        None, group="rest", env="EVERSTEP_REST_TLS_CERT",
        help="PEM certificate (chain) of the REST API; with --rest-tls-key it serves HTTPS only "
             "(env EVERSTEP_REST_TLS_CERT)")
    rest_tls_key: str | None = _option(None, group="rest", env="EVERSTEP_REST_TLS_KEY",
                                       help="PEM private key of --rest-tls-cert (env EVERSTEP_REST_TLS_KEY)")
    max_request_bytes: int = _option(
        1024 * 1024, check=_at_least(1024), group="rest", env="EVERSTEP_MAX_REQUEST_BYTES",
        help="larger REST request bodies get 413 (env EVERSTEP_MAX_REQUEST_BYTES; default %(default)s)")

    def __post_init__(self) -> None:
        check_settings(self)
        check_backoff(self.retry_initial_seconds, self.retry_max_seconds,
                      names=("retry_initial_seconds", "retry_max_seconds"))

    @staticmethod
    def options() -> list[tuple[dataclasses.Field, type, Option]]:
        """Each field with its value type (int, float or str; None allowed where the default is None) and option."""
        hints = typing.get_type_hints(ControllerSettings)
        out = []
        for f in dataclasses.fields(ControllerSettings):
            kind = hints[f.name]
            if isinstance(kind, types.UnionType):
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            out.append((f, kind, f.metadata["option"]))
        return out

    @staticmethod
    def default(name: str) -> Any:  # noqa: ANN401 (any option's type)
        """The option's default (its environment variable is read by the flags, not here)."""
        default = ControllerSettings.__dataclass_fields__[name].default
        if default is dataclasses.MISSING:
            raise KeyError(f"option {name!r} has no default")
        return default


def check_settings(settings: object) -> None:
    """Runs the option's check of every field of a settings object: `ControllerSettings`'s own, and the
    `setting(...)` fields of another; SettingError naming the object's own field."""
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        option = f.metadata.get("option")
        if option is None and "setting" in f.metadata:
            option = ControllerSettings.__dataclass_fields__[f.metadata["setting"]].metadata["option"]
        value = getattr(settings, f.name)
        if option is not None and option.check is not None and value is not None:
            problem = option.check(value)
            if problem:
                raise SettingError(f.name, problem)


def check_backoff(initial_seconds: float, max_seconds: float, *, names: tuple[str, str]) -> None:
    """Retries wait at least `initial_seconds` and at most `max_seconds`."""
    if not 0 < initial_seconds <= max_seconds:
        raise SettingError(names[0], f"({initial_seconds}) must be positive and at most {names[1]} ({max_seconds})")


def setting(name: str) -> Any:  # noqa: ANN401 (any option's type)
    """A dataclass field that holds the option `name` of `ControllerSettings`: its default (and, through
    `check_settings`, its check) are that option's."""
    return field(default=ControllerSettings.default(name), metadata={"setting": name})


def from_settings(cls: type[_T], settings: ControllerSettings, **others: Any) -> _T:
    """A `cls` whose `setting(...)` fields have the values of `settings`' options (`others`: its other fields)."""
    values = {f.name: getattr(settings, f.metadata["setting"]) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if "setting" in f.metadata}
    return cls(**values, **others)
