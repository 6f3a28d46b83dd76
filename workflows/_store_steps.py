"""A quick store step of a request (claim, token, release): a local activity, tried again on
durable timers while the store is away, until a time the caller gives (`reach.policy`'s store
backoff decides each wait)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from reach.messages import ErrorInfo
    from reach.policy import Failure, GiveUp, after_store_failure
    from workflows._failures import ONE_ATTEMPT, STORE_STEP, error_of


async def store_step(
    name: str,
    arg: Any,
    result_type: type[Any],
    until_ms: int,
    *,
    now_ms: Callable[[], int],
    sleep: Callable[[float], Awaitable[None]],
) -> Any:
    """Local activity `name`'s result; its last failure (`Failed`) once the store is not back
    before `until_ms`, or the failure is for good."""
    waits = 0
    while True:
        try:
            return await workflow.execute_local_activity(
                name,
                arg,
                result_type=result_type,
                schedule_to_close_timeout=STORE_STEP,
                retry_policy=ONE_ATTEMPT,
            )
        except (ActivityError, ApplicationError, TimeoutError) as exc:
            failed = error_of(exc, None)
            if failed.error.type == "timeout":
                failed.error = ErrorInfo(
                    type="unavailable",
                    message=f"the policy store did not answer ({name})",
                    retryable=True,
                )
            step = after_store_failure(
                waits, Failure(failed.error), now_ms=now_ms(), until_ms=until_ms
            )
            if isinstance(step, GiveUp):
                raise failed from exc
            workflow.logger.warning(
                "%s failed (%s); trying again in %.1fs", name, failed.error.message, step.delay_s
            )
            waits += 1
            await sleep(step.delay_s)
