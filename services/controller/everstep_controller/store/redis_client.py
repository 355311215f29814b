"""The controller's Redis client: it waits out a Redis restart instead of failing the jobs.

Every command is retried on a lost connection, a timeout or a Redis still loading its
append-only file, with exponential backoff (0.05 s doubling to 1 s), for `retry_seconds`; then
the error is raised. A transaction that WATCHes keys is not retried by the client (its watch
died with the connection): redis-py raises WatchError, and every such transaction in the
controller re-reads and retries on WatchError. A command that reached Redis but whose reply was
lost may run twice; the controller's writes tolerate that (see `progress_store`, `streams`).

Nothing acknowledged is lost across a Redis crash only if Redis fsyncs every write
(`appendonly yes`, `appendfsync always`), as the embedded Redis of `everstep up` does; with
`appendfsync everysec` (Redis' default) a crash may lose the last second of writes, and a
clean restart (SIGTERM) loses nothing. For a Redis given by `REDIS_URL` or the chart's
`redis.external.url`, persistence is that server's setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

__all__ = ["TimedRetry", "connect"]


class TimedRetry(Retry):
    """redis-py's Retry bounded by time instead of a count.

    redis-py nests retries (a command's, and inside it the reconnection's); with counts the
    waits would multiply, with one time limit each nested loop ends by the same deadline.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), retries=-1,
                         supported_errors=(ConnectionError, TimeoutError, BusyLoadingError))
        self.seconds = seconds

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], is_retryable: Callable | None = None,
                        with_failure_count: bool = False) -> Any:
        deadline = time.monotonic() + self.seconds
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                pause = self._backoff.compute(failures)
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)


def connect(url: str, *, retry_seconds: float = 30.0, socket_timeout_seconds: float = 30.0) -> redis.Redis:
    """A client for `url` whose commands are retried for `retry_seconds` (0: not retried)."""
    if retry_seconds < 0:
        raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
    return redis.Redis.from_url(url, retry=TimedRetry(retry_seconds), socket_timeout=socket_timeout_seconds,
                                socket_connect_timeout=min(5.0, socket_timeout_seconds))
