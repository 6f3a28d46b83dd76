"""The engine floors: the smallest workflows that do what an invoke does — one local activity
(inline mode), or one regular activity on another task queue (queue mode).

Kept in its own module with nothing but Temporal imports, so the sandbox loads it as cheaply as
it can; the activity it calls lives in bench/invoke.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow


@workflow.defn
class RawWorkflow:
    @workflow.run
    async def run(self, url: str) -> Any:
        return await workflow.execute_local_activity(
            "call_agent", url, schedule_to_close_timeout=timedelta(seconds=30)
        )


@workflow.defn
class RawQueueWorkflow:
    @workflow.run
    async def run(self, url: str, task_queue: str) -> Any:
        return await workflow.execute_activity(
            "call_agent",
            url,
            task_queue=task_queue,
            schedule_to_close_timeout=timedelta(seconds=30),
        )
