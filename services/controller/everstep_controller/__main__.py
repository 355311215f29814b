"""`python -m everstep_controller`: the REST API and the job runner in one process."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="everstep_controller", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=0, help="unused: the controller serves REST only")
    p.add_argument("--redis-url", required=True, help="redis://host:port/db holding all job state")
    p.add_argument("--rollout", required=True, help="rollout engine gRPC address host:port")
    p.add_argument("--trainer", required=True, help="trainer gRPC address host:port")
    p.add_argument("--reward", required=True, help="reward service gRPC address host:port")
    p.add_argument("--data-dir", default=".everstep/data", help="checkpoints of jobs without checkpoint.dir")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import redis
    import uvicorn

    from everstep_controller.api import create_app
    from everstep_controller.clients import ServiceEndpoints
    from everstep_controller.job_manager import JobManager
    from everstep_controller.job_store import JobStore

    store = JobStore(redis.Redis.from_url(args.redis_url))
    store.redis.ping()
    endpoints = ServiceEndpoints(rollout=args.rollout, trainer=args.trainer, reward=args.reward)
    manager = JobManager(store, endpoints, Path(args.data_dir))
    manager.start()
    try:
        uvicorn.run(create_app(manager, store), host=args.host, port=args.port, log_level="warning")
    finally:
        manager.stop()


if __name__ == "__main__":
    main()
