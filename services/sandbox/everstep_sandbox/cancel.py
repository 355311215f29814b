"""A request's cancellation: set when its client goes away (or the server stops), it drops the request
from the slot queue or kills its run."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["CancelToken", "Cancelled"]


class Cancelled(RuntimeError):
    """The request was cancelled (its client disconnected): nobody waits for its answer."""

    def __init__(self, message: str, *, queued: bool = False) -> None:
        super().__init__(message)
        self.queued = queued
        """Dropped from the queue before it took a slot."""


class CancelToken:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback` once on cancellation (at once if already cancelled); returns its remover."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def check(self) -> None:
        if self.cancelled:
            raise Cancelled("the client went away")
