"""`python -m everstep_reward --host H --port P --grpc-port G [--sandbox-endpoint HOST:PORT]
[--math-workers N] [--reward-model PATH] ...` (see --help)."""

from __future__ import annotations

import argparse
import logging
import os

from everstep.transport.channels import add_transport_arguments, apply_transport_arguments
from everstep_reward.item_log import ITEM_LOG_ENV

TRANSPORT_FLAGS = (  # read by everstep.transport.channels from the environment, not by RewardConfig
    "grpc_tls_cert", "grpc_tls_key", "grpc_tls_ca", "grpc_tls_server_name", "grpc_max_message_bytes")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everstep_reward", description="everstep reward service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9105, help="Prometheus /metrics")
    parser.add_argument("--grpc-port", type=int, default=50054)
    parser.add_argument("--sandbox-endpoint", default=None,
                        help="sandbox gRPC target of the code verifier: HOST:PORT, dns:///HOST:PORT (every address "
                             "the name resolves to) or ipv4:A:P,B:P; calls go round robin over the addresses")
    parser.add_argument("--math-workers", type=int, default=None, help="math worker processes (default min(4, CPUs))")
    parser.add_argument("--timeout-seconds", type=float, default=None, help="per-item math timeout (default 10)")
    parser.add_argument("--code-timeout-seconds", type=float, default=None,
                        help="limit of one sandbox RunTests call (default 60)")
    parser.add_argument("--code-run-timeout-seconds", type=float, default=None,
                        help="sandbox run limit per test case (default 5)")
    parser.add_argument("--code-compile-timeout-seconds", type=float, default=None,
                        help="sandbox compile limit per sample (default 10)")
    parser.add_argument("--code-reward-mode", choices=("fraction", "all_pass"), default=None,
                        help="code score: fraction of tests passed (default) or all_pass (items may override)")
    parser.add_argument("--format-require-think", action="store_true", default=None,
                        help="format rule: a closed <think> block is required (items may override)")
    parser.add_argument("--length-max", type=int, default=None,
                        help="length verifier L_max, in tokens (default 4096; items may override)")
    parser.add_argument("--length-cache", type=int, default=None,
                        help="length verifier L_cache, in tokens (default 512; items may override)")
    parser.add_argument("--length-unit", choices=("words", "chars"), default=None,
                        help="how L is counted for items without num_response_tokens (default words)")
    parser.add_argument("--reward-model", default=None,
                        help="HF sequence-classification reward model dir (needs the [model] extra)")
    parser.add_argument("--reward-model-device", default=None, help="torch device (default cpu)")
    parser.add_argument("--reward-model-max-tokens", type=int, default=None)
    parser.add_argument("--reward-model-batch-size", type=int, default=None)
    parser.add_argument("--reward-model-threads", type=int, default=None)
    parser.add_argument("--function-isolation", choices=("process", "none"), default=None,
                        help="how the jobs' reward functions run: process (default: isolated workers, no network, "
                             "memory and CPU limits) or none (in this process: trusted code only)")
    parser.add_argument("--function-workers", type=int, default=None, help="worker processes per function (default 2)")
    parser.add_argument("--function-timeout-seconds", type=float, default=None,
                        help="per-call limit of a reward function (default 10)")
    parser.add_argument("--function-memory-mb", type=int, default=None,
                        help="address-space limit of a function worker (default 2048)")
    parser.add_argument("--function-cpu-seconds", type=int, default=None,
                        help="CPU seconds a function worker may use before it is replaced (default 600)")
    parser.add_argument("--function-allowed-imports", type=lambda v: tuple(m for m in v.split(",") if m), default=None,
                        help="comma-separated top-level modules reward functions may import (default: math_verify, "
                             "sympy, numpy, math, re, json and the standard library's pure helpers)")
    parser.add_argument("--function-allow-network", action="store_true", default=None,
                        help="grant network to the functions of jobs that ask for it (default: refused)")
    parser.add_argument("--item-log", default=os.environ.get(ITEM_LOG_ENV) or None,
                        help="JSONL file: one line per scored item (prompt, response, reward); {pid} is replaced by "
                             "the process id (default: $EVERSTEP_REWARD_ITEM_LOG, else none)")
    add_transport_arguments(parser, balanced=True)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    apply_transport_arguments(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from everstep_reward.config import RewardConfig
    from everstep_reward.server import serve

    given = {k: v for k, v in vars(args).items() if v is not None and k not in TRANSPORT_FLAGS}
    serve(RewardConfig(**given))


if __name__ == "__main__":
    main()
