"""Activities that await long work heartbeat while it runs, so a lost worker is noticed within
the heartbeat timeout rather than the whole activity's."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from temporalio import activity

from reach.messages import Reply

HEARTBEAT_EVERY_S = 2.0

T = TypeVar("T")


async def awaited(work: Coroutine[Any, Any, Reply]) -> Reply:
    """A local activity awaits the call; a regular one heartbeats while it runs."""
    if activity.info().is_local:
        return await work
    return await heartbeating(work)


async def heartbeating(work: Coroutine[Any, Any, T], every_s: float = HEARTBEAT_EVERY_S) -> T:
    """Await a long call as a regular activity, heartbeating so a lost worker is noticed."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()
