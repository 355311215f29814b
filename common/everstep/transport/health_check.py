"""`python -m everstep.transport.health_check HOST:PORT [--service NAME] [--timeout-seconds S]`: exit 0 when SERVING.

The kubelet's own gRPC probe speaks plaintext only; with mutual TLS between services the chart
probes through this command instead, which dials like every service does (`everstep.transport.channels`).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from everstep.transport.channels import channel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="everstep.transport.health_check", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help="health service name ('' : the whole server)")
    parser.add_argument("--timeout-seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    try:
        with channel(args.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                         timeout=args.timeout_seconds)
    except (grpc.RpcError, ValueError) as e:
        print(f"{args.address}: {e}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
