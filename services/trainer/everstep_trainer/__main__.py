"""`python -m everstep_trainer --host H --port P --grpc-port G`: parse arguments first, then import torch.

Several ranks on one machine: `--nproc-per-node N` re-executes this command under torchrun
(`torch.distributed.run --standalone`). Several machines: `--nnodes N --node-rank K --master-addr HOST
--master-port P` on each (the same N, HOST and P everywhere; HOST reaches node 0, which hosts the
rendezvous store on P) re-executes it under torchrun's static rendezvous, `--nproc-per-node` ranks on
each node. Under torchrun (WORLD_SIZE > 1 in the environment, also when you run `torchrun --nnodes ...
-m everstep_trainer ...` yourself) rank 0 serves gRPC and metrics on the given ports and broadcasts
every call to the other ranks, which follow; FSDP2 shards the model across all of them (gloo on CPU,
nccl with one GPU per rank). Every rank must be able to read the model and checkpoint paths (one
machine, or a shared filesystem).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from everstep.transport.channels import add_transport_arguments, apply_transport_arguments
from everstep_trainer.weight_push.plan import Transport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="everstep_trainer", description="everstep policy trainer (gRPC).")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind gRPC and metrics to")
    parser.add_argument("--port", type=int, default=9102, help="HTTP port of Prometheus /metrics")
    parser.add_argument("--grpc-port", type=int, default=50052, help="gRPC port of the Trainer service")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="trainer ranks on this machine (> 1: relaunch under torchrun; FSDP2 across them)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="trainer nodes (machines) of one process group (> 1: --node-rank and --master-addr too)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's index, 0 to --nnodes - 1; node 0's rank 0 serves gRPC, the others follow")
    parser.add_argument("--master-addr", default="",
                        help="host of node 0, where every node meets (torchrun's static rendezvous); with --nnodes > 1")
    parser.add_argument("--master-port", type=int, default=29500,
                        help="port of the rendezvous store on node 0 (with --nnodes > 1)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--weight-transport", default="auto",
                        choices=[t.value for t in Transport],
                        help="default transport of PushWeights: auto picks per engine cuda_ipc (same GPU), nccl "
                             "(both on GPUs), shm (same host), else grpc")
    parser.add_argument("--weight-group-host", default="",
                        help="address engines reach this trainer at for a nccl/gloo weight group "
                             "(default: --host if specific, else 127.0.0.1, which only engines on this host reach: "
                             "remote engines need it set)")
    parser.add_argument("--shm-copies", type=int, default=1, choices=[1, 2],
                        help="full shm weight pushes: 1 (default) lets CPU engines run on the shared memory segment "
                             "the trainer wrote (two segments alternate), 2 has them copy out of it (one segment); "
                             "see docs/weight-push.md")
    add_transport_arguments(parser)
    parser.add_argument("--sample-log", default=os.environ.get("EVERSTEP_TRAINER_SAMPLE_LOG", ""),
                        help="append one JSON line per train step with its samples to this file ('{pid}' is replaced "
                             "by the process id; default: $EVERSTEP_TRAINER_SAMPLE_LOG, else none)")
    args = parser.parse_args(argv)
    apply_transport_arguments(parser, args)  # torchrun's ranks inherit the environment
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        parser.error(f"--nnodes: must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank: must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.master_addr:
        parser.error("--master-addr: required with --nnodes > 1 (the host of node 0, reachable from every node)")
    return args


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """torchrun running `--nproc-per-node` copies of this command. One node: a standalone rendezvous; several: the
    static one at --master-addr:--master-port, as node `--node-rank` of `--nnodes`."""
    rendezvous = (["--standalone"] if args.nnodes == 1 else
                  [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
                   f"--master-port={args.master_port}"])
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={args.nproc_per_node}",
               "-m", "everstep_trainer", "--host", args.host, "--port", str(args.port),
               "--grpc-port", str(args.grpc_port), "--log-level", args.log_level,
               "--weight-transport", args.weight_transport, "--weight-group-host", args.weight_group_host,
               "--sample-log", args.sample_log, "--shm-copies", str(args.shm_copies)]
    return command


def _relaunch_under_torchrun(args: argparse.Namespace) -> None:
    """Replace this process by torchrun (same process group, so stopping this pid's group stops every rank of this
    node)."""
    os.execv(sys.executable, torchrun_command(args))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if (args.nproc_per_node > 1 or args.nnodes > 1) and "WORLD_SIZE" not in os.environ:
        _relaunch_under_torchrun(args)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s" if world_size > 1
                        else "%(asctime)s %(levelname)s %(name)s: %(message)s")
    from everstep_trainer.server import serve, serve_distributed  # heavy: torch, transformers

    run = serve_distributed if world_size > 1 else serve
    run(host=args.host, port=args.port, grpc_port=args.grpc_port, weight_transport=args.weight_transport,
        weight_group_host=args.weight_group_host, sample_log=args.sample_log, shm_one_copy=args.shm_copies == 1)


if __name__ == "__main__":
    main()
