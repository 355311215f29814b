"""`python -m everstep_sandbox --host H --port P --grpc-port G [--workers N]`."""

from __future__ import annotations

import argparse
import logging
import os


def main() -> None:
    parser = argparse.ArgumentParser(prog="everstep_sandbox", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="HTTP: SandboxFusion API, /metrics, /healthz")
    parser.add_argument("--grpc-port", type=int, default=50055)
    parser.add_argument("--workers", type=int, default=None, help="concurrent commands (default: CPU count)")
    parser.add_argument("--default-memory-limit-mb", type=int, default=None,
                        help="RLIMIT_AS when a request gives none (default 1024)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The sandbox forks for every run while gRPC threads are busy; grpc's fork handlers would
    # only log a warning per fork (the children exec at once and never touch gRPC).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

    from everstep_sandbox.config import SandboxConfig
    from everstep_sandbox.server import serve

    overrides = {k: v for k, v in {"workers": args.workers,
                                   "default_memory_limit_mb": args.default_memory_limit_mb}.items()
                 if v is not None}
    serve(SandboxConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, **overrides))


if __name__ == "__main__":
    main()
