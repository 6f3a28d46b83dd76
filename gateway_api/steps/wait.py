"""Step 10, wait: a synchronous request's verdict, read where it is already known.

This process's worker usually completes the request's workflow in its first task (eager
start): its result is read from there once Temporal recorded it (`Finishes`), else it is
long-polled. A verdict not in by the deadline (plus `SYNC_GRACE_S`, for the workflow's own
timeout verdict) comes back as `running` with a retryable timeout: the request is still
tracked, and the caller can ask again by RequestID.

When the gateway stops (SIGTERM), waits in flight are let finish for `transport.drain_s` at
most (`drain`): past it a wait still open is answered `running` the same way, naming the
gateway's stop, so a long deadline never holds a shutdown (the request itself goes on: any
gateway answers for it by RequestID).

A front may let a request go before its verdict (`LetGo`): after a while (A2A's
returnImmediately, an MCP task: 0 s, or the MCP tasks extension's 1 s), or when its caller went
away (an HTTP client that disconnected). The wait then ends at once and the request is answered
`accepted`, like a request with a callback: the door holds nothing of it any more (no waiter, no
room among the bytes in flight) and its result is read from its workflow later (GetTask,
tasks/get, GET /reach/requests/{id}).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway_api.engine import Engine
from gateway_api.steps.start import Started
from gateway_api.temporal_adapter import Finish, Finishes
from reach.errors import ErrorType
from reach.messages import ErrorInfo, InvokeResponse

# How long past its deadline a synchronous caller waits for the workflow's own verdict.
SYNC_GRACE_S = 5.0

# When a front lets its request go: after so many seconds, or once the future is done.
LetGo = float | asyncio.Future[Any] | None


class Verdicts:
    """Counts, for every synchronous wait, how its result was read (`reach_sync_results_total`)."""

    def __init__(self, engine: Engine, finishes: Finishes | None) -> None:
        self.engine = engine
        self.finishes = finishes
        self.answered_here = 0
        self.long_polled = 0
        self._waits: set[asyncio.Timeout] = set()
        self._drain_by: float | None = None  # loop time past which no wait is held
        self._drainer: asyncio.Task[None] | None = None

    def drain(self, stopping: asyncio.Event, drain_s: float) -> None:
        """Once `stopping` is set, end every wait `drain_s` later at the latest."""

        async def watch() -> None:
            await stopping.wait()
            loop = asyncio.get_running_loop()
            self._drain_by = loop.time() + drain_s
            for scope in self._waits:
                self._bound(scope)

        self._drainer = asyncio.create_task(watch(), name="reach-drain-waits")

    def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()

    def _bound(self, scope: asyncio.Timeout) -> None:
        when = scope.when()
        if self._drain_by is not None and (when is None or when > self._drain_by):
            scope.reschedule(self._drain_by)

    def expect(self, request_id: str) -> Finish | None:
        """Watch for the request's end before its start is sent (its first task can run
        before the start call returns); None: no watching here."""
        return self.finishes.expect(request_id) if self.finishes is not None else None

    def done(self, wait: Finish | None) -> None:
        if self.finishes is not None and wait is not None:
            self.finishes.done(wait)

    def counts(self) -> dict[str, int]:
        return {"worker": self.answered_here, "long_poll": self.long_polled}

    async def verdict(
        self, run: Started, wait: Finish | None, now_ms: int, let_go: LetGo = None
    ) -> InvokeResponse:
        handle = run.handle
        budget = max(0.0, run.deadline_ms / 1000 - time.time()) + SYNC_GRACE_S
        if isinstance(let_go, float | int) and let_go <= 0:
            return accepted(handle.id)  # let go at once: nothing to wait for
        scope = asyncio.timeout(budget)
        cut = _Cut(scope, let_go)
        try:
            # A deadline on this task, not wait_for's task per request (one loop turn less).
            async with scope:
                self._waits.add(scope)
                cut.arm()
                self._bound(scope)
                if cut.gone:
                    return accepted(handle.id)
                if wait is not None and run.started:
                    payload = await wait.result(handle)
                    if payload is not None:
                        self.answered_here += 1
                        return await self.engine.decode(payload)
                self.long_polled += 1
                return await self.engine.outcome(handle)
        except TimeoutError:
            if cut.gone:
                return accepted(handle.id)
            if self._drain_by is not None:
                return _running(
                    handle.id,
                    now_ms,
                    "unavailable",
                    "this gateway is stopping before the verdict; the request goes on and any "
                    f"gateway answers for it: GET /reach/requests/{handle.id}",
                )
            return _running(
                handle.id,
                now_ms,
                "timeout",
                "no verdict by the deadline (is a worker running?); the request "
                f"is still tracked: GET /reach/requests/{handle.id}",
            )
        finally:
            cut.disarm()
            self._waits.discard(scope)


class _Cut:
    """A wait's `LetGo`: it moves the wait's deadline to when the front lets go."""

    __slots__ = ("closed", "gone", "let_go", "scope", "timer")

    def __init__(self, scope: asyncio.Timeout, let_go: LetGo) -> None:
        self.scope = scope
        self.let_go = let_go
        self.gone = False
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        let_go = self.let_go
        if let_go is None:
            return
        if isinstance(let_go, asyncio.Future):
            if let_go.done():
                self.gone = True
            else:
                let_go.add_done_callback(self._now)
            return
        loop = asyncio.get_running_loop()
        when = self.scope.when()
        if when is None or loop.time() + let_go < when:
            self.timer = loop.call_later(let_go, self._now, None)

    def _now(self, _: object) -> None:
        if self.gone or self.closed:
            return
        try:
            self.scope.reschedule(asyncio.get_running_loop().time())
        except RuntimeError:  # its deadline has just passed: it ends as it would have
            return
        self.gone = True

    def disarm(self) -> None:
        # A call already scheduled (a future done a moment ago) must not touch the ended wait.
        if self.timer is not None:
            self.timer.cancel()
        if isinstance(self.let_go, asyncio.Future):
            self.let_go.remove_done_callback(self._now)
        self.closed = True


def accepted(request_id: str) -> InvokeResponse:
    """A request its front let go: durable, answered as accepted, its result read later."""
    return InvokeResponse(request_id=request_id, status="accepted")


def _running(request_id: str, now_ms: int, kind: ErrorType, message: str) -> InvokeResponse:
    return InvokeResponse(
        request_id=request_id,
        status="running",
        duration_ms=int(time.time() * 1000) - now_ms,
        error=ErrorInfo(type=kind, message=message, retryable=True),
    )
