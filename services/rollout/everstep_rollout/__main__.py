"""`python -m everstep_rollout`: the rollout gRPC server (arguments first, heavy imports after)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from everstep.transport.channels import add_transport_arguments, apply_transport_arguments

STOP_GRACE_SECONDS = 5.0
"""After SIGTERM/SIGINT: how long open Generate streams may go on before they are cancelled."""
SIGTERM_STOP_SECONDS = 12.0
"""The most the server takes from SIGTERM to exit, mid-Generate included: the grace, then the engine's stop. The
chart's terminationGracePeriodSeconds (60) is checked against it (tests/deploy); tests/rollout measures it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="everstep_rollout", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC and metrics)")
    p.add_argument("--port", type=int, required=True, help="HTTP port of Prometheus /metrics")
    p.add_argument("--grpc-port", type=int, required=True, help="gRPC port")
    p.add_argument("--model", default=None, help="Hugging Face model directory to load at start")
    p.add_argument("--engine", choices=["torch", "sglang"], default="torch",
                   help="torch: our engine (CPU or GPU); sglang: sglang's offline engine (GPU, in its own "
                        "environment: make sglang-venv, or deploy/docker/rollout-sglang.Dockerfile)")
    p.add_argument("--executor", choices=["auto", "native", "transformers"], default="auto",
                   help="torch engine: native (Llama/Qwen2/Qwen3/Qwen3-MoE), transformers (any causal LM), "
                        "auto: native if supported")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", choices=["none", "int8", "int8-tensor", "fp8", "int4"], default="none",
                   help="weight-only quantization of the linear layers (native executor): int8 per output channel, "
                        "int8-tensor per tensor, fp8 (e4m3) per output channel, int4 per output channel and group "
                        "of 32 inputs; applied at load and to every weight update; a job's LoadModel sets its own")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoded together (KV cache slots)")
    p.add_argument("--max-queued", type=int, default=4096, help="sequences that may wait; more are refused")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + output tokens per sequence (default: the model's max_position_embeddings, at most "
                        "2048); a job's LoadModel sets its own; above the model's limit: refused")
    p.add_argument("--seed", type=int, default=0, help="engine sampling seed")
    p.add_argument("--sandbox-endpoint", default="",
                   help="sandbox gRPC target (HOST:PORT, dns:///HOST:PORT or ipv4:A:P,B:P; calls go round robin "
                        "over its addresses), for jobs whose model calls the python tool")
    p.add_argument("--mem-fraction-static", type=float, default=0.0,
                   help="sglang engine: fraction of GPU memory for weights and KV cache; 0: sglang's default "
                        "(most of the GPU; set it when a trainer shares the GPU)")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0: all cores but one")
    p.add_argument("--no-share-prompt-prefill", dest="share_prompt_prefill", action="store_false",
                   help="torch engine: prefill every sample of a prompt on its own (default: the copies admitted "
                        "together are prefilled once; EngineConfig.share_prompt_prefill)")
    add_transport_arguments(p)
    args = p.parse_args(argv)
    apply_transport_arguments(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from prometheus_client import start_http_server

    from everstep_rollout import metrics
    from everstep_rollout.config import EngineConfig, default_num_threads
    from everstep_rollout.engine import EngineUnavailableError
    from everstep_rollout.server import RolloutServicer, build_server, set_serving

    torch.set_num_threads(args.num_threads or default_num_threads())
    engine_defaults = EngineConfig(
        engine=args.engine, executor=args.executor, max_running=args.max_running, max_queued=args.max_queued,
        max_seq_len=args.max_seq_len, dtype=args.dtype, device=args.device, seed=args.seed,
        mem_fraction_static=args.mem_fraction_static, quantization=args.quantization,
        sandbox_endpoint=args.sandbox_endpoint, share_prompt_prefill=args.share_prompt_prefill,
    )
    servicer = RolloutServicer(engine_defaults)
    metrics.bind_status(servicer.status)
    start_http_server(args.port, addr=args.host)
    server, health_servicer = build_server(servicer, args.host, args.grpc_port)
    if args.model:
        try:
            servicer.load(args.model)
        except EngineUnavailableError as e:
            logging.getLogger("everstep_rollout").error("cannot start: %s", e)
            server.stop(grace=0)
            return 2
    set_serving(health_servicer)
    logging.getLogger("everstep_rollout").info(
        "rollout serving: gRPC %s:%d, metrics http://%s:%d/metrics, %d torch threads",
        args.host, args.grpc_port, args.host, args.port, torch.get_num_threads(),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log = logging.getLogger("everstep_rollout")
    log.info("stopping: open Generate streams get %.0f s", STOP_GRACE_SECONDS)
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=STOP_GRACE_SECONDS).wait()
    log.info("gRPC stopped; stopping the engine")
    servicer.shutdown()
    log.info("rollout stopped")
    # Nothing is left to save, and only daemon threads remain; the interpreter's own teardown (torch's and gRPC's
    # finalizers) took about 3 s more on a 2-core machine, time the pod's grace period need not pay.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
