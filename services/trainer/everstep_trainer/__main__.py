"""`python -m everstep_trainer --host H --port P --grpc-port G`: parse arguments first, then import torch."""

from __future__ import annotations

import argparse
import logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="everstep_trainer", description="everstep policy trainer (gRPC).")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind gRPC and metrics to")
    parser.add_argument("--port", type=int, default=9102, help="HTTP port of Prometheus /metrics")
    parser.add_argument("--grpc-port", type=int, default=50052, help="gRPC port of the Trainer service")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--weight-transport", default="auto",
                        choices=["auto", "grpc", "shm", "nccl", "gloo", "cuda_ipc"],
                        help="default transport of PushWeights: auto picks per engine cuda_ipc (same GPU), nccl "
                             "(both on GPUs), shm (same host), else grpc")
    parser.add_argument("--weight-group-host", default="",
                        help="address engines reach this trainer at for a nccl/gloo weight group "
                             "(default: --host if specific, else what the host name resolves to)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from everstep_trainer.server import serve  # heavy: torch, transformers

    serve(host=args.host, port=args.port, grpc_port=args.grpc_port, weight_transport=args.weight_transport,
          weight_group_host=args.weight_group_host)


if __name__ == "__main__":
    main()
