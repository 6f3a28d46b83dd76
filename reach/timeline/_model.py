"""The timeline's data: history events in, timeline events out, and small shared readers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from reach.security.redact import safe_url

LOCAL_ACTIVITY_MARKER = "core_local_activity"
# A synthetic event the reader adds for an activity under way (history records it at its end).
PENDING_ACTIVITY = "pending_activity"


@dataclass(frozen=True)
class HistoryEvent:
    """One history event as plain data.

    `type` is Temporal's event type in lower case without its prefix
    (`EVENT_TYPE_TIMER_STARTED` -> `timer_started`). `attrs` holds what the timeline reads,
    payloads decoded to JSON values and failures to `failure_dict` form:

    - workflow_execution_started: input
    - marker_recorded: marker, data, result, failure, task (the workflow task that recorded it)
    - activity_task_scheduled: activity_type, activity_id, input, task_queue
    - activity_task_started: scheduled_event_id, attempt, last_failure
    - activity_task_completed: scheduled_event_id, result
    - activity_task_failed / activity_task_timed_out: scheduled_event_id, failure
    - timer_started: timer_id, start_to_fire_ms; timer_fired: timer_id
    - workflow_execution_update_accepted / workflow_execution_signaled: name, args
    - start_child_workflow_execution_initiated: workflow_type, workflow_id, input
    - start_child_workflow_execution_failed: workflow_type, cause
    - workflow_execution_completed: result; _failed: failure; _terminated: reason
    - pending_activity: activity_id, activity_type, state (scheduled | started), attempt,
      started_ms, last_failure, next_attempt_ms
    """

    event_id: int
    type: str
    time_ms: float
    attrs: dict[str, Any] = field(default_factory=dict)


def failure_dict(
    kind: str,
    type_: str,
    message: str,
    *,
    details: list[Any] | None = None,
    timeout_type: str | None = None,
    cause: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A decoded failure: `kind` application | timeout | canceled | terminated | other."""
    return {
        "kind": kind,
        "type": type_,
        "message": message,
        "details": details or [],
        "timeout_type": timeout_type,
        "cause": cause,
    }


class TimelineEvent(BaseModel):
    at_ms: int = Field(description="Milliseconds after the request was accepted.")
    kind: str = Field(description="What happened (see `reach.timeline`), e.g. attempt_failed.")
    summary: str = Field(description="One line for people.")
    detail: dict[str, Any] = Field(default_factory=dict, description="The facts, for scripts.")


class Timeline(BaseModel):
    """A request's story from its workflow history (R16)."""

    request_id: str
    status: str = Field(description="running, success, error or timeout")
    accepted_at: datetime | None = Field(
        default=None, description="When the gateway accepted it: offset 0."
    )
    events: list[TimelineEvent]


# -- shared by the readers ------------------------------------------------------------


@dataclass
class Activity:
    type: str
    start_ms: float
    input: Any = None
    task_queue: str | None = None
    activity_id: str | None = None
    started_ms: float | None = None
    attempt: int = 1
    last_failure: dict[str, Any] | None = None


@dataclass
class Entry:
    time_ms: float
    event: TimelineEvent


def ms(value: float) -> str:
    return f"{round(value)} ms"


def seconds(ms: float) -> str:
    return f"{ms / 1000:g} s"


def timestamp_ms(value: Any) -> float | None:
    """A protobuf Timestamp as JSON (`{"seconds", "nanos"}` or an RFC 3339 string)."""
    if isinstance(value, dict) and "seconds" in value:
        return float(value["seconds"]) * 1000 + float(value.get("nanos") or 0) / 1e6
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000
        except ValueError:
            return None
    return None


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def error_of(failure: dict[str, Any] | None) -> dict[str, Any]:
    """What the workflow made of an activity's failure (as `workflows._attempts.error_of`)."""
    failure = failure or {}
    if failure.get("kind") == "timeout":
        if failure.get("timeout_type") == "heartbeat":
            return {
                "type": "transport_error",
                "message": "the worker was lost mid-call",
                "retryable": True,
                "outcome_unknown": True,
            }
        return {"type": "timeout", "message": "deadline reached", "retryable": False}
    details = failure.get("details") or []
    first = as_dict(details[0]) if details else {}
    error: dict[str, Any] = {
        "type": failure.get("type") or failure.get("kind") or "internal",
        "message": failure.get("message") or "",
        "retryable": bool(first.get("retryable")),
    }
    if first.get("outcome_unknown"):
        error["outcome_unknown"] = True
    if first.get("agent"):
        error["agent"] = first["agent"]
    if first.get("retry_after_s") is not None:
        error["retry_after_s"] = first["retry_after_s"]
    return error


def shown_url(url: object) -> str | None:
    """A callback URL as a timeline shows it: without credentials, query or fragment."""
    return safe_url(url) if isinstance(url, str) and url else None
