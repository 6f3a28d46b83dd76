"""Step 10, wait: a synchronous request's verdict, read where it is already known.

This process's worker usually completes the request's workflow in its first task (eager
start): its result is read from there once Temporal recorded it (`Finishes`), else it is
long-polled. A verdict not in by the deadline (plus `SYNC_GRACE_S`, for the workflow's own
timeout verdict) comes back as `running` with a retryable timeout: the request is still
tracked, and the caller can ask again by RequestID.
"""

from __future__ import annotations

import asyncio
import time

from gateway_api.engine import Engine
from gateway_api.steps.start import Started
from gateway_api.temporal_adapter import Finish, Finishes
from reach.messages import ErrorInfo, InvokeResponse

# How long past its deadline a synchronous caller waits for the workflow's own verdict.
SYNC_GRACE_S = 5.0


class Verdicts:
    """Counts, for every synchronous wait, how its result was read (`reach_sync_results_total`)."""

    def __init__(self, engine: Engine, finishes: Finishes | None) -> None:
        self.engine = engine
        self.finishes = finishes
        self.answered_here = 0
        self.long_polled = 0

    def expect(self, request_id: str) -> Finish | None:
        """Watch for the request's end before its start is sent (its first task can run
        before the start call returns); None: no watching here."""
        return self.finishes.expect(request_id) if self.finishes is not None else None

    def done(self, wait: Finish | None) -> None:
        if self.finishes is not None and wait is not None:
            self.finishes.done(wait)

    def counts(self) -> dict[str, int]:
        return {"worker": self.answered_here, "long_poll": self.long_polled}

    async def verdict(self, run: Started, wait: Finish | None, now_ms: int) -> InvokeResponse:
        handle = run.handle
        budget = max(0.0, run.deadline_ms / 1000 - time.time()) + SYNC_GRACE_S
        try:
            # A deadline on this task, not wait_for's task per request (one loop turn less).
            async with asyncio.timeout(budget):
                if wait is not None and run.started:
                    payload = await wait.result(handle)
                    if payload is not None:
                        self.answered_here += 1
                        return await self.engine.decode(payload)
                self.long_polled += 1
                return await self.engine.outcome(handle)
        except TimeoutError:
            return InvokeResponse(
                request_id=handle.id,
                status="running",
                duration_ms=int(time.time() * 1000) - now_ms,
                error=ErrorInfo(
                    type="timeout",
                    message="no verdict by the deadline (is a worker running?); the request "
                    f"is still tracked: GET /reach/requests/{handle.id}",
                    retryable=True,
                ),
            )
