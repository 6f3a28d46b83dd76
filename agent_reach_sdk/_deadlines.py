"""The deadline keeper: each handler in a task of its own, given up on at the request's deadline.

Given up on, not waited for: a handler that ignores its cancellation keeps running, unheard, and
the answer (a timeout) is not held up by it. Such handlers are held here by RequestID until they
end, so that they are not destroyed mid-cleanup, a re-delivery of the same request is not run
beside them, and the runtime's stop waits for their cleanup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("agent_reach_sdk")

# The last millisecond of the year 9999: a later deadline is not a time (nor a float's).
LATEST_DEADLINE_MS = 253_402_300_799_999


class DeadlinePassed(Exception):
    """The request's deadline passed first (a TimeoutError the handler raises is its own)."""


class DeadlineKeeper:
    __slots__ = ("overdue",)

    def __init__(self) -> None:
        # Handlers given up on (deadline, shutdown) that still run, by RequestID.
        self.overdue: dict[str, asyncio.Task[Any]] = {}

    async def run(
        self, request_id: str, work: Coroutine[Any, Any, Any], timeout_s: float | None
    ) -> Any:
        """`work`'s result, run in a task of its own; `DeadlinePassed` after `timeout_s`.

        Its own task: a context variable the handler sets stays its own (a keep-alive
        connection's next request runs in the caller's task). A cancellation from outside
        (shutdown, the caller gone) cancels it and ends the request at once.
        """
        loop = asyncio.get_running_loop()
        task = loop.create_task(work)
        settled: asyncio.Future[None] = loop.create_future()

        def settle(_: object = None) -> None:
            if not settled.done():
                settled.set_result(None)

        task.add_done_callback(settle)
        timer = loop.call_later(timeout_s, settle) if timeout_s is not None else None
        try:
            await settled
        except asyncio.CancelledError:
            self._give_up(request_id, task)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            task.remove_done_callback(settle)
        if not task.done():
            self._give_up(request_id, task)
            raise DeadlinePassed
        if task.cancelled():  # the handler raised CancelledError itself; nobody cancelled it
            raise RuntimeError("the handler raised CancelledError without being cancelled")
        return task.result()

    def _give_up(self, request_id: str, task: asyncio.Task[Any]) -> None:
        task.cancel()
        if not task.done():
            self.overdue[request_id] = task

            def ended(_: object) -> None:
                if self.overdue.get(request_id) is task:
                    del self.overdue[request_id]

            task.add_done_callback(ended)
        task.add_done_callback(_forget)

    async def drain(self, grace_s: float) -> None:
        """Wait (at stop) for the handlers already cancelled to finish their cleanup."""
        if self.overdue:
            _, stuck = await asyncio.wait(set(self.overdue.values()), timeout=max(grace_s, 1.0))
            if stuck:
                log.warning("%d handlers still running after their cancellation", len(stuck))


def _forget(task: asyncio.Future[Any]) -> None:
    """A handler given up on: what it ends with is read, so asyncio does not log it as never
    retrieved (an error it raised is the handler's own; the request was already answered)."""
    if not task.cancelled():
        task.exception()
