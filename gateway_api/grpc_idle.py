"""A gRPC stream's idle bound, kept cheaply: the Heartbeat stream (`gateway_api._grpc_beats`)
ends when no report comes for `registry.heartbeat_timeout`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleWatch:
    """Ends a stream whose next report does not come within `idle_s()`: one timer per idle
    period, re-armed when it finds the stream busy or the wait younger (a timer per report, as
    `asyncio.timeout` around each read, cost more than the rest of a report's handling)."""

    __slots__ = ("_handle", "_idle_s", "_loop", "_task", "expired", "since")

    def __init__(self, idle_s: Callable[[], float]) -> None:
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.since: float | None = None  # when the wait for the next report began
        self.expired = False
        self._handle = self._loop.call_later(idle_s(), self._check)

    def waiting(self) -> None:
        self.since = self._loop.time()

    def busy(self) -> None:
        self.since = None

    def _check(self) -> None:
        now, idle_s = self._loop.time(), self._idle_s()
        if self.since is not None and now - self.since >= idle_s:
            # Cancelled at its read: the report read in this very instant (if any) is dropped
            # with the stream, never half applied.
            self.expired = True
            self._task.cancel()
            return
        due = (self.since if self.since is not None else now) + idle_s
        self._handle = self._loop.call_at(due, self._check)

    def close(self) -> None:
        self._handle.cancel()
