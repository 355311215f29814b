"""`python -m everstep_sandbox --host H --port P --grpc-port G [--workers N] [--processes K] [--allow-no-seccomp]`."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from everstep.transport.channels import add_transport_arguments, apply_transport_arguments


def _exit_with_parent(parent_pid: int) -> None:
    """A worker process stops (gracefully) when the process that started it is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(prog="everstep_sandbox", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="HTTP: SandboxFusion API, /metrics, /healthz")
    parser.add_argument("--grpc-port", type=int, default=50055)
    parser.add_argument("--workers", type=int, default=None, help="sandbox slots per process (default: CPU count)")
    parser.add_argument("--processes", type=int, default=1, help="worker processes sharing the ports")
    parser.add_argument("--slot-offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-of", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--http-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-slots", type=int, default=None,
                        help="slots this process may run at once: elastic ones beyond --workers are started on "
                             "demand and stopped when idle (default 128)")
    parser.add_argument("--isolation", choices=("auto", "bubblewrap", "none"), default="auto",
                        help="auto: bubblewrap when it works here, else a logged fallback")
    parser.add_argument("--default-memory-limit-mb", type=int, default=None,
                        help="memory limit of a run when a request gives none or -1 (default: the slot's "
                             "ceiling, --max-memory-limit-mb)")
    parser.add_argument("--max-memory-limit-mb", type=int, default=None,
                        help="the slot's memory ceiling; a request asking for more is refused (default 8192)")
    parser.add_argument("--max-timeout-seconds", type=float, default=None,
                        help="longest compile_timeout or run_timeout a request may ask for (default 1800)")
    parser.add_argument("--allow-no-seccomp", action="store_true",
                        help="start even when no seccomp filter can be installed (libseccomp missing, or the "
                             "kernel refuses it); by default such a sandbox exits with status 3")
    add_transport_arguments(parser, balanced=True)
    args = parser.parse_args()
    apply_transport_arguments(parser, args)  # before starting worker processes: they inherit the environment
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The sandbox forks while gRPC threads are busy; grpc's fork handlers would only log a warning.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    metrics_dir = None
    if args.processes > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Must be set before prometheus_client is imported (here and, inherited, in the workers).
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="everstep-sandbox-metrics-")
    if args.worker_of is not None:
        _exit_with_parent(args.worker_of)

    from everstep_sandbox.config import SandboxConfig
    from everstep_sandbox.isolation.seccomp import SeccompUnavailable
    from everstep_sandbox.server import PortInUse, serve

    overrides = {k: v for k, v in {"workers": args.workers,
                                   "default_memory_limit_mb": args.default_memory_limit_mb,
                                   "max_memory_limit_mb": args.max_memory_limit_mb,
                                   "max_timeout_seconds": args.max_timeout_seconds,
                                   "max_slots": args.max_slots}.items()
                 if v is not None}
    try:
        serve(SandboxConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, processes=args.processes,
                            slot_offset=args.slot_offset, isolation=args.isolation,
                            allow_no_seccomp=args.allow_no_seccomp, **overrides),
              argv=sys.argv[1:] if args.worker_of is None else None, http_fd=args.http_fd)
    except PortInUse as e:
        logging.getLogger("everstep_sandbox").error("%s", e)
        sys.exit(2)
    except SeccompUnavailable as e:
        logging.getLogger("everstep_sandbox").error("%s", e)
        sys.exit(3)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
