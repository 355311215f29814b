"""`python -m everstep_controller`: the REST API and the job runners in one process."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from everstep.transport import add_transport_arguments, apply_transport_arguments
from everstep_controller.request_limits import DEFAULT_MAX_REQUEST_BYTES

_GRACEFUL_SHUTDOWN_SECONDS = 3.0
"""How long a stopping controller waits for open REST connections: an idle HTTPS keep-alive client
would otherwise hold it until the TLS close handshake times out (30 s), past the pod's grace period."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="everstep_controller", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=0, help="unused: the controller serves REST only")
    p.add_argument("--redis-url", required=True, help="redis://host:port/db holding all job state")
    p.add_argument("--reward", required=True, help="reward service gRPC address host:port (a shared pool)")
    p.add_argument("--launcher", choices=("local", "kubernetes", "shared"), default=None,
                   help="who gives each job its rollout engine and trainer: 'local' processes, 'kubernetes' "
                        "workloads, or the 'shared' ones at --rollout/--trainer (one job at a time). "
                        "Default: shared when --rollout and --trainer are given, else local")
    p.add_argument("--rollout", default=None, help="shared rollout engine gRPC address (launcher shared)")
    p.add_argument("--trainer", default=None, help="shared trainer gRPC address (launcher shared)")
    p.add_argument("--max-jobs", type=int, default=None,
                   help="jobs run at once (default: 1 with shared workers, 4 with local ones, 16 on Kubernetes)")
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="a job whose controller has not renewed its lease this long is taken over")
    p.add_argument("--num-scorers", type=int, default=2, help="threads per job sending rollouts to the reward service")
    p.add_argument("--threads-per-worker", type=int, default=0,
                   help="local launcher: torch threads of each worker process (0: their default)")
    p.add_argument("--k8s-namespace", default=None,
                   help="kubernetes launcher: namespace of the workloads (default: the controller pod's own)")
    p.add_argument("--k8s-template-prefix", default="everstep",
                   help="kubernetes launcher: the chart's fullname; PodTemplates <prefix>-rollout, <prefix>-trainer")
    p.add_argument("--data-dir", default=".everstep/data",
                   help="checkpoints of jobs without checkpoint.dir, and local workers' logs")
    p.add_argument("--log-level", default="INFO")
    rest = p.add_argument_group("REST security",
                                "the bearer token is read from EVERSTEP_API_TOKEN; see docs/security.md")
    rest.add_argument("--rest-tls-cert", default=os.environ.get("EVERSTEP_REST_TLS_CERT") or None,
                      help="PEM certificate (chain) of the REST API; with --rest-tls-key it serves HTTPS only "
                           "(env EVERSTEP_REST_TLS_CERT)")
    rest.add_argument("--rest-tls-key", default=os.environ.get("EVERSTEP_REST_TLS_KEY") or None,
                      help="PEM private key of --rest-tls-cert (env EVERSTEP_REST_TLS_KEY)")
    rest.add_argument("--max-request-bytes", type=int,
                      default=int(os.environ.get("EVERSTEP_MAX_REQUEST_BYTES") or DEFAULT_MAX_REQUEST_BYTES),
                      help="larger REST request bodies get 413 (env EVERSTEP_MAX_REQUEST_BYTES; default "
                           f"{DEFAULT_MAX_REQUEST_BYTES})")
    add_transport_arguments(p)  # the controller dials the services: its channels use the same settings
    args = p.parse_args(argv)
    apply_transport_arguments(p, args)  # local launcher workers inherit the environment
    if bool(args.rest_tls_cert) != bool(args.rest_tls_key):
        p.error("--rest-tls-cert and --rest-tls-key go together")
    for flag in ("rest_tls_cert", "rest_tls_key"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            p.error(f"--{flag.replace('_', '-')} {path!r} is not a file")
    if args.max_request_bytes < 1024:
        p.error(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if args.launcher is None:
        args.launcher = "shared" if args.rollout and args.trainer else "local"
    if args.launcher == "shared" and not (args.rollout and args.trainer):
        p.error("--launcher shared needs --rollout and --trainer")
    if args.launcher != "shared" and (args.rollout or args.trainer):
        # the chart always passes them; with another launcher they are unused, and said so
        logging.getLogger("everstep_controller").warning(
            "--rollout/--trainer are ignored: the %s launcher starts each job's own workers", args.launcher)
    return args


def _own_namespace() -> str:
    """The namespace of the pod this runs in (its service account's), else 'default'."""
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "default"


def build_launcher(args: argparse.Namespace):  # noqa: ANN201 (imports stay lazy)
    from everstep_controller.launchers import make_launcher

    if args.launcher == "shared":
        return make_launcher("shared", rollout=args.rollout, trainer=args.trainer)
    if args.launcher == "local":
        return make_launcher("local", work_dir=Path(args.data_dir) / "workers", max_jobs=args.max_jobs or 4,
                             threads_per_worker=args.threads_per_worker)
    return make_launcher("kubernetes", namespace=args.k8s_namespace or _own_namespace(),
                         template_prefix=args.k8s_template_prefix,
                         max_jobs=args.max_jobs or 16)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    import redis
    import uvicorn

    from everstep_controller.api import create_app
    from everstep_controller.job_manager import JobManager
    from everstep_controller.job_runner import RunnerSettings
    from everstep_controller.job_store import JobStore

    store = JobStore(redis.Redis.from_url(args.redis_url))
    store.redis.ping()
    launcher = build_launcher(args)
    manager = JobManager(store, launcher, args.reward, Path(args.data_dir), max_jobs=args.max_jobs,
                         lease_seconds=args.lease_seconds,
                         runner_settings=RunnerSettings(num_scorers=args.num_scorers))
    manager.start()
    try:
        uvicorn.run(create_app(manager, store, max_request_bytes=args.max_request_bytes), host=args.host,
                    port=args.port, log_level="warning", ssl_certfile=args.rest_tls_cert,
                    ssl_keyfile=args.rest_tls_key, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS)
    finally:
        # local workers go with the controller (`everstep down`); Kubernetes ones stay for the next
        # controller pod to re-attach to
        manager.stop(stop_workers=args.launcher == "local")


if __name__ == "__main__":
    main()
