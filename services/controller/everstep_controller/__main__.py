"""`python -m everstep_controller`: the REST API and the job runners in one process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from pathlib import Path

from everstep.transport.channels import add_transport_arguments, apply_transport_arguments
from everstep_controller.settings import ControllerSettings, SettingError

_GRACEFUL_SHUTDOWN_SECONDS = 3.0
"""How long a stopping controller waits for open REST connections: an idle HTTPS keep-alive client
would otherwise hold it until the TLS close handshake times out (30 s), past the pod's grace period."""

_JOBS_STOP_SECONDS = 6.0
"""How long a stopping controller waits for its job threads to reach a point where they can stop."""
SIGTERM_STOP_SECONDS = 15.0
"""The most the controller takes from SIGTERM to exit, mid-job included (REST connections, then the job threads,
then the launcher's close). The chart's terminationGracePeriodSeconds (30) is checked against it (tests/deploy);
tests/faults/test_controller_sigterm.py measures it."""

_GROUPS = {"rest": ("REST security", "the bearer token is read from EVERSTEP_API_TOKEN; see docs/security.md")}


def build_parser() -> argparse.ArgumentParser:
    """The flags of `ControllerSettings`' fields, in their order (`--lease-seconds` for `lease_seconds`)."""
    p = argparse.ArgumentParser(prog="everstep_controller", description=__doc__)
    groups = {key: p.add_argument_group(title, description) for key, (title, description) in _GROUPS.items()}
    for f, kind, option in ControllerSettings.options():
        default = f.default
        if option.env and os.environ.get(option.env):
            default = kind(os.environ[option.env])
        where = groups[option.group] if option.group else p
        kwargs = {"required": True} if default is dataclasses.MISSING else {"default": default}
        if kind is not str:
            kwargs["type"] = kind
        where.add_argument(f"--{f.name.replace('_', '-')}", choices=option.choices, help=option.help, **kwargs)
    add_transport_arguments(p)  # the controller dials the services: its channels use the same settings
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    apply_transport_arguments(p, args)  # local launcher workers inherit the environment
    try:
        settings_from_args(args)
    except SettingError as e:
        p.error(f"--{e.name.replace('_', '-')} {e.message}")
    if bool(args.rest_tls_cert) != bool(args.rest_tls_key):
        p.error("--rest-tls-cert and --rest-tls-key go together")
    for flag in ("rest_tls_cert", "rest_tls_key"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            p.error(f"--{flag.replace('_', '-')} {path!r} is not a file")
    if args.launcher is None:
        args.launcher = "shared" if args.rollout and args.trainer else "local"
    if args.launcher == "shared" and not (args.rollout and args.trainer):
        p.error("--launcher shared needs --rollout and --trainer")
    if args.launcher != "shared" and (args.rollout or args.trainer):
        # the chart always passes them; with another launcher they are unused, and said so
        logging.getLogger("everstep_controller").warning(
            "--rollout/--trainer are ignored: the %s launcher starts each job's own workers", args.launcher)
    return args


def settings_from_args(args: argparse.Namespace) -> ControllerSettings:
    """The options parsed; SettingError naming the option that is out of range."""
    return ControllerSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ControllerSettings)})


def _own_namespace() -> str:
    """The namespace of the pod this runs in (its service account's), else 'default'."""
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "default"


def build_launcher(args: argparse.Namespace):  # noqa: ANN201 (imports stay lazy)
    from everstep_controller.launchers import make_launcher

    def local(max_jobs: int):  # noqa: ANN202
        return make_launcher("local", work_dir=Path(args.data_dir) / "workers", max_jobs=max_jobs,
                             threads_per_worker=args.threads_per_worker, threads_per_engine=args.threads_per_engine)

    if args.launcher == "shared":
        return make_launcher("shared", rollout=args.rollout, trainer=args.trainer,
                             engines_on_demand=local(1) if args.engines_on_demand == "local" else None)
    if args.launcher == "local":
        return local(args.max_jobs or 4)
    return make_launcher("kubernetes", namespace=args.k8s_namespace or _own_namespace(),
                         template_prefix=args.k8s_template_prefix,
                         max_jobs=args.max_jobs or 16)


def runner_settings(args: argparse.Namespace):  # noqa: ANN201 (imports stay lazy)
    """Every job runner's settings: those of the parsed options."""
    from everstep_controller.run.runner_settings import RunnerSettings

    return RunnerSettings.from_settings(settings_from_args(args))


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    logging.getLogger("everstep_controller").info("signal %d: stopping", signum)
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    import uvicorn

    from everstep_controller.api.app import create_app
    from everstep_controller.run.manager import JobManager
    from everstep_controller.store.job_store import JobStore
    from everstep_controller.store.redis_client import connect

    settings = runner_settings(args)
    store = JobStore(connect(args.redis_url, retry_seconds=args.redis_retry_seconds))
    store.redis.ping()
    launcher = build_launcher(args)
    manager = JobManager(store, launcher, args.reward, Path(args.data_dir), max_jobs=args.max_jobs,
                         lease_seconds=args.lease_seconds, runner_settings=settings,
                         finished_series_seconds=args.finished_job_series_seconds)
    manager.start()
    # uvicorn serves until SIGTERM/SIGINT, then raises the signal again under the handler it found: with
    # Python's default for SIGTERM the process would die there, before the clean-up below
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(create_app(manager, store, max_request_bytes=args.max_request_bytes), host=args.host,
                    port=args.port, log_level="warning", ssl_certfile=args.rest_tls_cert,
                    ssl_keyfile=args.rest_tls_key, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS)
    finally:
        # local workers go with the controller (`everstep down`); Kubernetes ones stay for the next
        # controller pod to re-attach to
        manager.stop(stop_workers=args.launcher == "local", timeout_seconds=_JOBS_STOP_SECONDS)


if __name__ == "__main__":
    main()
