"""What the attempt loop makes of a failed step: `Failed` (a Reach error, and the instance it
was sent to, if any), `StaleRoute` (nothing was sent), and `error_of`, which reads an
activity's failure as the `ErrorInfo` the policy decides on."""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    TimeoutError,
    TimeoutType,
)

with workflow.unsafe.imports_passed_through():
    from reach.errors import ERROR_TYPES, AgentFault
    from reach.messages import ErrorInfo


class Failed(Exception):
    def __init__(self, error: ErrorInfo, instance_id: str | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.instance_id = instance_id


class StaleRoute(Exception):
    """The instance chosen at the door left before anything was sent."""


def error_of(exc: FailureError, instance_id: str | None) -> Failed:
    # Regular activities fail with ActivityError(cause=...); local ones with the cause itself.
    cause = exc.cause if isinstance(exc, ActivityError) else exc
    if isinstance(cause, TimeoutError):
        if cause.type == TimeoutType.HEARTBEAT:
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
    return Failed(info, instance_id)
