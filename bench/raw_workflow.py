"""The engine floor: the smallest workflow that does what an invoke does (one local activity).

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
            "call_agent", url, schedule_to_close_timeout=timedelta(seconds=5)
        )
