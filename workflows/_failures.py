"""What the attempt loop makes of a failed step: `Failed` (a Reach error, and the instance it
was sent to, if any), `StaleRoute` (nothing was sent), and `error_of`, which reads an
activity's failure as the `ErrorInfo` the policy decides on — or, when the failure is the
request's own cancel (a workflow cancel: A2A CancelTask, MCP tasks/cancel, an operator), raises
`asyncio.CancelledError`, as a cancelled timer does, so the request ends `canceled`
(`InvokeWorkflow.run`) rather than reading the cancelled activity as a bug in Reach."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    TimeoutError,
    TimeoutType,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from reach.errors import ERROR_TYPES, AgentFault
    from reach.invocation import (
        ACTIVITY_PINNED,
        ACTIVITY_PINNED_ATTEMPT,
        CallInput,
        InvokeInput,
        PinQuery,
    )
    from reach.messages import ErrorInfo
    from reach.policy import Attempts, Failure

ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)
# A workflow's history when its first task runs: started, task scheduled, task started. More
# means an earlier task ran (and may have sent the call) and was lost with its worker.
FIRST_TASK_EVENTS = 3
# Store steps (claims, tokens, a pin read) are quick; this bounds one that is not.
STORE_STEP = timedelta(seconds=10)
# Requests accepted before a lost task's attempt was named ended without reading its pin; those
# accepted before it was named when a later failure ended the request (after a store wait or a
# retry: the lost run is remembered, `reach.policy.retry.LOST_RUN`) left it unnamed then.
PATCH_NAME_LOST_ATTEMPT = "name-lost-attempt"
PATCH_NAME_LOST_LATER = "name-lost-attempt-later"
# Requests accepted before it ended an attempt whose deadline came before this run routed it
# (after a wait: the store, a token, a backoff) as never sent, without reading its pin.
PATCH_LOST_AFTER_WAIT = "lost-after-wait-read-pin"


class Failed(Exception):
    def __init__(
        self,
        error: ErrorInfo,
        instance_id: str | None,
        *,
        not_sent: bool = False,
        claimed: bool = False,
        unrouted: bool = False,
        pinned_before: bool = False,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.instance_id = instance_id
        self.not_sent = not_sent  # the call activity refused it before sending (NotSent)
        # This run claimed the attempt's send-once claim itself: no earlier run sent it.
        self.claimed = claimed
        # The deadline came before this run routed the attempt (`sent_by_lost_run`).
        self.unrouted = unrouted
        # Another run had pinned the door's route first: a lost task's, which may have sent it.
        self.pinned_before = pinned_before


class StaleRoute(Exception):
    """The instance chosen at the door left before anything was sent (by this run: a lost
    task's pin says that one may have sent it there, `pinned_before`)."""

    def __init__(self, message: str, *, pinned_before: bool = False) -> None:
        super().__init__(message)
        self.pinned_before = pinned_before

    @classmethod
    def of(cls, cause: ApplicationError) -> StaleRoute:
        details: Any = cause.details[0] if cause.details else {}
        before = isinstance(details, dict) and bool(details.get("pinned_before"))
        return cls(cause.message, pinned_before=before)


# Requests accepted before a cancel of theirs ended them `canceled` read a cancelled activity
# as `internal` and ended cancelled (no result) on a timer; their histories replay so.
PATCH_CALLER_CANCEL = "caller-cancel-ends-canceled"


def cancel_requested() -> bool:
    """Whether the request's workflow was asked to stop and follows the rule that ends it
    `canceled` (its patch marker is recorded the first time a cancel is seen)."""
    return workflow.cancellation_reason() is not None and workflow.patched(PATCH_CALLER_CANCEL)


def error_of(exc: FailureError, instance_id: str | None, *, routing: bool = False) -> Failed:
    """`routing`: the failed step is a resolve (queue mode's heartbeats as a call does)."""
    if is_cancelled_exception(exc) and cancel_requested():
        # The workflow's cancel cancelled the activity: the request ends canceled.
        raise asyncio.CancelledError(workflow.cancellation_reason()) from exc
    # Regular activities fail with ActivityError(cause=...); local ones with the cause itself.
    cause = exc.cause if isinstance(exc, ActivityError) else exc
    not_sent = claimed = before = False
    if isinstance(cause, TimeoutError):
        if cause.type == TimeoutType.HEARTBEAT and routing:
            # Lost while choosing an instance: nothing was sent, so the same attempt is
            # routed again after a wait (as after a store outage), no retry spent on it.
            info = ErrorInfo(
                type="unavailable",
                message="the worker was lost while routing the request; nothing was sent",
                retryable=True,
            )
            not_sent = True
        elif cause.type == TimeoutType.HEARTBEAT:
            info = ErrorInfo(
                type="transport_error",
                message="the worker was lost mid-call",
                retryable=True,
                outcome_unknown=True,
            )
        else:
            info = ErrorInfo(type="timeout", message="deadline reached", retryable=False)
    elif isinstance(cause, ApplicationError):
        details: Any = cause.details[0] if cause.details else {}
        if not isinstance(details, dict):
            details = {}
        if details.get("not_sent"):
            not_sent = True
        claimed = bool(details.get("claimed"))
        before = bool(details.get("pinned_before"))
        # The activities raise only Reach's own types; anything else is a bug in Reach.
        known = cause.type in ERROR_TYPES
        info = ErrorInfo(
            type=cause.type if known else "internal",
            message=cause.message if known else f"{cause.type}: {cause.message}",
            retryable=bool(details.get("retryable")),
            agent=AgentFault.model_validate(details["agent"]) if details.get("agent") else None,
            retry_after_s=details.get("retry_after_s"),
            outcome_unknown=details.get("outcome_unknown"),
        )
    else:
        info = ErrorInfo(type="internal", message=str(cause or exc), retryable=False)
    return Failed(info, instance_id, not_sent=not_sent, claimed=claimed, pinned_before=before)


def forget_unsent(sent_to: dict[str, str | None], call: CallInput, *, queue: bool) -> None:
    """The door's route found stale on the first run of its call (or in queue mode, where no
    call runs again silently) was never sent, nor by a lost task: its instance is not one the
    request went to, so its principal does not answer it (2ff98de's validator reads `sent_to`;
    after a re-run, the lost task may have sent it there, and it still may)."""
    if call.first_run or queue:
        sent_to.pop(call.endpoint.instance_id, None)


def names_lost_later(sent: bool, tries: Attempts) -> bool:
    """Whether a report that names no instance should name attempt 1's: this failure was, or
    may have been, sent, or an earlier, lost run of attempt 1 is remembered (asked only then)."""
    if sent:
        return True
    lost = tries.unknown is not None and tries.unknown.lost_run
    return lost and workflow.patched(PATCH_NAME_LOST_LATER)


async def name_lost_attempt(inp: InvokeInput, report: Failure) -> Failure:
    """A lost task's attempt may have run: name the instance it went to, from the door's
    choice or the attempt's pin in the store (resolve records it before the call)."""
    if inp.endpoint is not None:
        return replace(report, instance_id=inp.endpoint.instance_id)
    if not workflow.patched(PATCH_NAME_LOST_ATTEMPT):
        return report
    try:
        pinned: str = await workflow.execute_local_activity(
            ACTIVITY_PINNED,
            inp.request_id,
            result_type=str,
            schedule_to_close_timeout=STORE_STEP,
            retry_policy=ONE_ATTEMPT,
        )
    except (ActivityError, ApplicationError, TimeoutError):
        workflow.logger.warning("the instance attempt 1 went to could not be read")
        return report
    return replace(report, instance_id=pinned or None)


async def sent_by_lost_run(inp: InvokeInput, attempt: int, made: int = 0) -> str | None:
    """The instance a lost workflow task sent attempt `attempt` to, when this run met the
    deadline before routing it: a task that ran the attempt after a wait (its timer fired in
    that task) and was lost with its worker leaves no trace in the history, only the pin its
    resolve claimed in the store before the call. None: no pin (nothing was routed), or the
    store could not say. `made`: this run's own claims of the pin (`workflows._pins`), which
    say nothing of a lost run."""
    if not workflow.patched(PATCH_LOST_AFTER_WAIT):
        return None
    try:
        pinned: str = await workflow.execute_local_activity(
            ACTIVITY_PINNED_ATTEMPT,
            PinQuery(request_id=inp.request_id, attempt=attempt, made=made),
            result_type=str,
            schedule_to_close_timeout=STORE_STEP,
            retry_policy=ONE_ATTEMPT,
        )
    except (ActivityError, ApplicationError, TimeoutError):
        workflow.logger.warning("whether a lost task sent attempt %d could not be read", attempt)
        return None
    return pinned or None


def cancelled(
    in_flight: bool, earlier_unknown: bool, instance_id: str | None, said: str | None
) -> ErrorInfo:
    """The error of a `canceled` request: who asked (the cancel's reason), and whether an agent
    may have run it — a call in flight (or accepted, or a task followed: `said` tells what the
    agent's task was asked), or an earlier attempt whose outcome nobody knows."""
    # The fronts' cancels name who asked; one with no reason came from outside them (an
    # operator's `temporal workflow cancel`, the Temporal UI).
    reason = workflow.cancellation_reason() or "no reason given: an operator's cancel"
    message = f"the request was cancelled ({reason}) before it had a result"
    if in_flight:
        message += f"; agent {instance_id} had it and may have run it in part or whole"
    elif earlier_unknown:
        to = f" to {instance_id}" if instance_id else ""  # a lost run's, before its pin is read
        message += f"; an earlier attempt{to} may have run it"
    if said is not None:
        message += f" ({said})"
    unknown = in_flight or earlier_unknown
    return ErrorInfo(
        type="request_closed",
        message=message,
        retryable=False,
        outcome_unknown=True if unknown else None,
    )
