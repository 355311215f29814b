"""The readiness check of the controller's REST API (/readyz): one PING to Redis, bounded in time.

The job store's client retries every command for --redis-retry-seconds (it waits out a Redis restart); a
probe must answer within its timeout instead, so it pings through its own connection pool to the same
server, without retries and with short socket timeouts.
"""

from __future__ import annotations

import threading

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["RedisProbe"]


class RedisProbe:
    """Pings the Redis server of `client` once, within `timeout_seconds`."""

    def __init__(self, client: redis.Redis, *, timeout_seconds: float = 2.0) -> None:
        self._source = client
        self._timeout = timeout_seconds
        self._client: redis.Redis | None = None
        self._lock = threading.Lock()

    def _probe_client(self) -> redis.Redis:
        with self._lock:
            if self._client is None:
                pool = self._source.connection_pool
                kwargs = {**pool.connection_kwargs, "socket_timeout": self._timeout,
                          "socket_connect_timeout": self._timeout, "retry": Retry(NoBackoff(), 0)}
                self._client = redis.Redis(connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, max_connections=4, **kwargs))
            return self._client

    def problem(self) -> str | None:
        """None when Redis answered the PING, else the kind of error (no address: the route is open)."""
        try:
            self._probe_client().ping()
        except (redis.RedisError, OSError) as e:
            return type(e).__name__
        return None
