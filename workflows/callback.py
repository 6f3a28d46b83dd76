"""DeliverCallbackWorkflow: POST a request's final envelope to the caller's callback URL.

A workflow of its own (id `<request_id>/callback`, started by InvokeWorkflow, which completes
without waiting for it), so the request's result is final and readable while a receiver that is
down is retried for up to `callback.retry_window_s`. Its status is the delivery's state:
running = pending (attempts and the last error in the pending activity), completed = delivered
or given up (the `DeliveryOutcome`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from reach.invocation import (
        ACTIVITY_DELIVER_CALLBACK,
        WORKFLOW_DELIVER_CALLBACK,
        CallbackInput,
        DeliveryOutcome,
    )
    from reach.security.redact import safe_url


# The delivery POST is scheduled with a heartbeat timeout (its activity heartbeats every second
# while the POST is in flight), so a worker that dies mid-POST is noticed within seconds and the
# POST is sent again elsewhere, not after the whole attempt timeout.
PATCH_CALLBACK_HEARTBEAT = "callback-heartbeat"
# 5 s: the SDK sends at most one heartbeat each 80% of the timeout (4 s here), which leaves a
# busy worker a second; a slower one's POST is only sent again (the receiver dedupes). Never
# longer than the attempt timeout, which would end the attempt first.
CALLBACK_HEARTBEAT_S = 5.0


def _attempts_and_reason(exc: ActivityError) -> tuple[int, str]:
    """The last attempt number the activity reported, and the last failure's words."""
    attempts, reason = 0, str(exc.cause or exc)
    cause: BaseException | None = exc.cause
    while cause is not None:
        if isinstance(cause, ApplicationError):
            details: Any = cause.details[0] if cause.details else {}
            if isinstance(details, dict) and isinstance(details.get("attempt"), int):
                attempts = details["attempt"]
            reason = cause.message
            break
        if isinstance(cause, FailureError):
            reason = cause.message or reason
            cause = cause.cause
        else:
            break
    return attempts, reason


async def deliver(inp: CallbackInput) -> DeliveryOutcome:
    """POST until delivered, refused for good, or the retry window is spent (workflow code)."""
    plan = inp.plan
    heartbeat = None
    if workflow.patched(PATCH_CALLBACK_HEARTBEAT):
        heartbeat = timedelta(seconds=min(CALLBACK_HEARTBEAT_S, plan.attempt_timeout_s))
    try:
        attempts = await workflow.execute_activity(
            ACTIVITY_DELIVER_CALLBACK,
            inp,
            result_type=int,
            start_to_close_timeout=timedelta(seconds=plan.attempt_timeout_s),
            heartbeat_timeout=heartbeat,
            schedule_to_close_timeout=timedelta(seconds=plan.retry_window_s),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=plan.initial_backoff_s),
                maximum_interval=timedelta(seconds=plan.max_backoff_s),
                backoff_coefficient=2.0,
            ),
        )
    except ActivityError as exc:
        # The result itself is not lost: it stays the request's result (GET /reach/requests/{id}).
        attempts, reason = _attempts_and_reason(exc)
        workflow.logger.warning("callback to %s given up: %s", safe_url(inp.url), reason)
        return DeliveryOutcome(status="given_up", attempts=attempts, last_error=reason)
    return DeliveryOutcome(status="delivered", attempts=attempts or 1)


@workflow.defn(name=WORKFLOW_DELIVER_CALLBACK)
class DeliverCallbackWorkflow:
    @workflow.run
    async def run(self, inp: CallbackInput) -> DeliveryOutcome:
        return await deliver(inp)
