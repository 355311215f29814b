"""`python -m everstep_reward --host H --port P --grpc-port G [--sandbox-endpoint HOST:PORT]
[--math-workers N] [--timeout-seconds S]`."""

from __future__ import annotations

import argparse
import logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="everstep_reward", description="everstep reward service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9105, help="Prometheus /metrics")
    parser.add_argument("--grpc-port", type=int, default=50054)
    parser.add_argument("--sandbox-endpoint", default=None, help="sandbox gRPC HOST:PORT (code verifier)")
    parser.add_argument("--math-workers", type=int, default=None, help="math worker processes (default min(4, CPUs))")
    parser.add_argument("--timeout-seconds", type=float, default=None, help="per-item math timeout (default 10)")
    parser.add_argument("--code-timeout-seconds", type=float, default=None,
                        help="limit of one sandbox RunTests call (default 60)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from everstep_reward.config import RewardConfig
    from everstep_reward.server import serve

    optional = {"sandbox_endpoint": args.sandbox_endpoint, "math_workers": args.math_workers,
                "timeout_seconds": args.timeout_seconds, "code_timeout_seconds": args.code_timeout_seconds}
    serve(RewardConfig(host=args.host, port=args.port, grpc_port=args.grpc_port,
                       **{k: v for k, v in optional.items() if v is not None}))


if __name__ == "__main__":
    main()
