"""`python -m everstep_trainer --host H --port P --grpc-port G`: parse arguments first, then import torch.

Several ranks: `torchrun --nproc-per-node N -m everstep_trainer ...` (torchrun sets WORLD_SIZE): rank 0
serves gRPC and metrics on the given ports and broadcasts every call to ranks 1..N-1, which follow;
FSDP2 shards the model across all N (gloo on CPU, nccl with one GPU per rank). Every rank must be able
to read the model and checkpoint paths (one machine, or a shared filesystem).
"""

from __future__ import annotations

import argparse
import logging
import os


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="everstep_trainer", description="everstep policy trainer (gRPC).")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind gRPC and metrics to")
    parser.add_argument("--port", type=int, default=9102, help="HTTP port of Prometheus /metrics")
    parser.add_argument("--grpc-port", type=int, default=50052, help="gRPC port of the Trainer service")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s" if world_size > 1
                        else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    from everstep_trainer.server import serve, serve_distributed  # heavy: torch, transformers

    run = serve_distributed if world_size > 1 else serve
    run(host=args.host, port=args.port, grpc_port=args.grpc_port)


if __name__ == "__main__":
    main()
