"""One look at an agent's long work (an A2A task) a call answered with a handle for
(`reach.follow_task`, scheduled by `workflows._following`).

A look is either questions (reads, safe to repeat, never a resend of the request: `GetTask`)
until the work ends or its window passes, or, when the look's handle says `SUBSCRIBE_KEY` and
the connector can, the task's stream held for the window (`TaskStreams.subscribe`) while the
activity heartbeats, so a worker lost mid-stream is noticed by Temporal within the look's
heartbeat timeout and the workflow looks again.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol, runtime_checkable

from temporalio import activity

from connectors import Connector
from reach.invocation import Endpoint, FollowTaskInput
from reach.messages import Reply

# Inside one look by questions: the pauses between them.
FOLLOW_FIRST_PAUSE_S = 0.01
FOLLOW_MAX_PAUSE_S = 1.0
# The look's handle key that asks for the stream (workflows._following.SUBSCRIBE_KEY: a
# workflow imports no activity module).
SUBSCRIBE_KEY = "subscribe"
# How often a look holding a stream heartbeats (its heartbeat timeout is 10 s).
STREAM_BEAT_S = 2.0


@runtime_checkable
class TaskStreams(Protocol):
    """A connector that can follow a task by its stream (A2A: `SubscribeToTask`)."""

    async def subscribe(
        self, endpoint: Endpoint, handle: dict[str, Any], window_s: float, timeout_s: float
    ) -> Reply: ...


async def look(connector: Connector, inp: FollowTaskInput, local: bool) -> Reply:
    """The look `inp` asks for; `local`: run as a local activity (no heartbeats)."""
    if inp.handle.get(SUBSCRIBE_KEY) is True and isinstance(connector, TaskStreams):
        return await _by_stream(connector, inp, local)
    return await _by_questions(connector, inp, local)


async def _by_stream(connector: TaskStreams, inp: FollowTaskInput, local: bool) -> Reply:
    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(STREAM_BEAT_S)

    beating = None if local else asyncio.create_task(beat())
    try:
        return await connector.subscribe(
            inp.endpoint, inp.handle, inp.window_ms / 1000, inp.timeout_ms / 1000
        )
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating


async def _by_questions(connector: Connector, inp: FollowTaskInput, local: bool) -> Reply:
    loop = asyncio.get_running_loop()
    until = loop.time() + inp.window_ms / 1000
    handle, pause = inp.handle, FOLLOW_FIRST_PAUSE_S
    first = True
    while True:
        left = until - loop.time()
        # The first question has its whole time (a window shorter than it, a push's look,
        # asks once); the next ones end within the window.
        timeout_s = inp.timeout_ms / 1000
        if not first and left > 0:
            timeout_s = min(timeout_s, left)
        first = False
        reply = await connector.follow(inp.endpoint, handle, timeout_s)
        if reply.status != "accepted" or until - loop.time() <= pause:
            return reply
        handle = {**handle, **(reply.follow or {})}
        if not local:
            activity.heartbeat()
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, FOLLOW_MAX_PAUSE_S)
