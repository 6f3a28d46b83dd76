"""A run that starts where an earlier workflow task of its request was lost (its gateway was
SIGKILLed, or Temporal away timed it out) and meets the deadline before it sent anything itself:
while it waited (the idempotency key's claim, the store), nothing in its history says what the
lost task did. That task may have claimed the key and sent attempt 1 (the door's route, on the
first task, is called unpinned), so the deadline is told as may-have-run unless the attempt's pin
positively shows no other run routed it.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from reach.invocation import ACTIVITY_PINNED_ATTEMPT, InvokeInput, PinQuery
    from workflows._failures import FIRST_TASK_EVENTS, ONE_ATTEMPT, STORE_STEP

# Requests accepted before it ended a run that started after a lost task, and met the deadline
# waiting (the idempotency claim, the store) before sending anything, as never sent.
PATCH_LOST_FIRST_TASK = "lost-first-task-read-pin"


def started_after_lost_task(history_at_start: int) -> bool:
    """Whether the run's first task found more in the history than a first task's: an earlier
    task ran (and may have sent attempt 1) and was lost."""
    return history_at_start > FIRST_TASK_EVENTS


async def sent_by_lost_first_task(inp: InvokeInput, made: int) -> tuple[bool, str | None] | None:
    """Whether a lost earlier task may have sent attempt 1, and to which instance; None for a
    request accepted before this rule (its caller does what it did then). `made`: this run's
    own pin claims of attempt 1 (`workflows._pins`), which say nothing of a lost task."""
    if not workflow.patched(PATCH_LOST_FIRST_TASK):
        return None
    door = inp.endpoint.instance_id if inp.endpoint is not None else None
    try:
        pinned: str = await workflow.execute_local_activity(
            ACTIVITY_PINNED_ATTEMPT,
            PinQuery(request_id=inp.request_id, attempt=1, made=made),
            result_type=str,
            schedule_to_close_timeout=STORE_STEP,
            retry_policy=ONE_ATTEMPT,
        )
    except (ActivityError, ApplicationError, TimeoutError):
        # Could not tell: an earlier task may have sent it.
        workflow.logger.warning("whether a lost earlier task sent attempt 1 could not be read")
        return True, door
    if pinned:
        return True, pinned
    # No pin: a resolve-routed attempt was never routed; the door's route is called unpinned
    # by the first task, so no pin says nothing of it.
    return (True, door) if door is not None else (False, None)
