"""A request's timeline read from Temporal: its workflow history (and its callback delivery's),
decoded with the client's data converter (the codec too, when payloads are encrypted) into the
plain events `reach.timeline` reads.

Read only by the timeline route and `reach trace`, never on the invoke path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.api.failure.v1 import Failure
from temporalio.api.history.v1 import HistoryEvent as ProtoEvent
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.converter import DataConverter
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    FailureError,
    TerminatedError,
    TimeoutError,
)
from temporalio.service import RPCError, RPCStatusCode

from reach import progress
from reach.errors import ReachError, UnknownRequest
from reach.invocation import WORKFLOW_INVOKE, delivery_workflow_id
from reach.policy.state import PolicyState
from reach.security.tokens import Principal
from reach.timeline import (
    PENDING_ACTIVITY,
    HistoryEvent,
    Timeline,
    build_timeline,
    failure_dict,
    with_logs,
    with_progress,
)
from workflows.invoke import SA_CALLER

_PREFIX = "EVENT_TYPE_"


async def read_timeline(
    client: Client,
    request_id: str,
    principal: Principal | None,
    rpc_timeout: timedelta,
    state: PolicyState | None = None,
) -> Timeline:
    """The request's timeline. With tokens required only its caller (or an admin) may read
    it; to anyone else it does not exist (as GET /reach/requests/{id}). `state`: the policy
    state holding its calls' progress notes and log messages (`reach.progress`), merged in as
    `progress` and `log` events; None: none shown."""
    handle = client.get_workflow_handle(request_id)
    desc = await _describe(client, request_id, rpc_timeout)
    if desc is None or desc.workflow_type != WORKFLOW_INVOKE:
        raise UnknownRequest(f"no request with id {request_id!r}")
    owner = desc.typed_search_attributes.get(SA_CALLER)
    if principal is not None and principal.kind != "admin" and owner != principal.name:
        raise UnknownRequest(f"no request with id {request_id!r}")
    raw = [e async for e in handle.fetch_history_events(rpc_timeout=rpc_timeout)]
    history = await decode_history(raw, client.data_converter)
    history += await _pending(desc, client.data_converter)
    delivery: list[HistoryEvent] = []
    started = history[0].attrs.get("input") if history else None
    if isinstance(started, dict) and started.get("callback"):
        delivery = await _delivery_history(client, request_id, rpc_timeout)
    timeline = build_timeline(request_id, history, delivery)
    if timeline.status == "running" and desc.status != WorkflowExecutionStatus.RUNNING:
        # Closed in a way history did not spell out (e.g. continued as new): say how.
        name = desc.status.name.lower() if desc.status else "closed"
        timeline.status = "timeout" if name == "timed_out" else "error"
    if state is not None:
        timeline = await _with_progress(timeline, state, request_id)
    return timeline


async def _with_progress(timeline: Timeline, state: PolicyState, request_id: str) -> Timeline:
    try:
        raw = await state.peek(progress.progress_key(request_id))
    except ReachError:  # the store is down: the history's story still stands
        return timeline
    count, notes = progress.decode(raw)
    timeline = with_progress(timeline, count, notes)
    return with_logs(timeline, *progress.decode_logs(raw))


async def _describe(
    client: Client, workflow_id: str, rpc_timeout: timedelta
) -> WorkflowExecutionDescription | None:
    try:
        return await client.get_workflow_handle(workflow_id).describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def _delivery_history(
    client: Client, request_id: str, rpc_timeout: timedelta
) -> list[HistoryEvent]:
    """The callback delivery workflow's history, plus its retrying attempt when it runs."""
    workflow_id = delivery_workflow_id(request_id)
    desc = await _describe(client, workflow_id, rpc_timeout)
    if desc is None:
        return []
    handle = client.get_workflow_handle(workflow_id, run_id=desc.run_id)
    raw = [e async for e in handle.fetch_history_events(rpc_timeout=rpc_timeout)]
    history = await decode_history(raw, client.data_converter)
    return history + await _pending(desc, client.data_converter)


async def _pending(
    desc: WorkflowExecutionDescription, converter: DataConverter
) -> list[HistoryEvent]:
    """A running workflow's activities under way, which history records only once they end."""
    if desc.status != WorkflowExecutionStatus.RUNNING:
        return []
    now_ms = time.time() * 1000
    out = []
    for pending in desc.raw_description.pending_activities:
        started = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        out.append(
            HistoryEvent(
                event_id=0,
                type=PENDING_ACTIVITY,
                time_ms=now_ms,
                attrs={
                    "activity_id": pending.activity_id,
                    "activity_type": pending.activity_type.name,
                    "state": "started" if started else "scheduled",
                    "attempt": pending.attempt,
                    "started_ms": _ms_of(pending.last_started_time)
                    if pending.HasField("last_started_time")
                    else None,
                    "last_failure": await _failure(converter, pending.last_failure)
                    if pending.HasField("last_failure")
                    else None,
                    "next_attempt_ms": _ms_of(pending.next_attempt_schedule_time)
                    if pending.HasField("next_attempt_schedule_time")
                    else None,
                },
            )
        )
    return out


def _ms_of(stamp: Any) -> float:
    return float(stamp.seconds) * 1000 + float(stamp.nanos) / 1e6


async def _values(converter: DataConverter, payloads: Payloads) -> list[Any]:
    """Payloads as JSON values; one that cannot be decoded (a key not held here) is None."""
    try:
        return await converter.decode_wrapper(payloads)
    except Exception:
        return [None] * len(payloads.payloads)


async def _first(converter: DataConverter, payloads: Payloads) -> Any:
    values = await _values(converter, payloads)
    return values[0] if values else None


async def _failure(converter: DataConverter, failure: Failure) -> dict[str, Any]:
    copy = Failure()
    copy.CopyFrom(failure)
    try:
        exc = await converter.decode_failure(copy)
    except Exception:
        return failure_dict("other", "undecodable", "the failure could not be decoded here")
    return _failure_of(exc)


def _failure_of(exc: BaseException) -> dict[str, Any]:
    cause = exc.__cause__ if isinstance(exc, FailureError) else None
    inner = _failure_of(cause) if cause is not None else None
    if isinstance(exc, ApplicationError):
        return failure_dict(
            "application",
            exc.type or "ApplicationError",
            exc.message,
            details=list(exc.details),
            cause=inner,
        )
    if isinstance(exc, TimeoutError):
        kind = exc.type.name.lower() if exc.type is not None else None
        return failure_dict("timeout", "timeout", exc.message, timeout_type=kind, cause=inner)
    if isinstance(exc, CancelledError):
        return failure_dict("canceled", "canceled", exc.message, cause=inner)
    if isinstance(exc, TerminatedError):
        return failure_dict("terminated", "terminated", exc.message, cause=inner)
    if isinstance(exc, FailureError):
        return failure_dict("other", type(exc).__name__, exc.message, cause=inner)
    return failure_dict("other", type(exc).__name__, str(exc))


async def decode_history(
    events: Sequence[ProtoEvent], converter: DataConverter
) -> list[HistoryEvent]:
    """History events as `reach.timeline.HistoryEvent`s (the ones it reads)."""
    out: list[HistoryEvent] = []
    for event in events:
        attrs = await _attrs(event, converter)
        if attrs is None:
            continue
        out.append(
            HistoryEvent(
                event_id=event.event_id,
                type=EventType.Name(event.event_type).removeprefix(_PREFIX).lower(),
                time_ms=_ms_of(event.event_time),
                attrs=attrs,
            )
        )
    return out


async def _attrs(event: ProtoEvent, converter: DataConverter) -> dict[str, Any] | None:
    kind = event.event_type
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
        a = event.workflow_execution_started_event_attributes
        return {"input": await _first(converter, a.input)}
    if kind == EventType.EVENT_TYPE_MARKER_RECORDED:
        m = event.marker_recorded_event_attributes
        details = m.details
        return {
            "marker": m.marker_name,
            "data": await _first(converter, details["data"]) if "data" in details else None,
            "result": await _first(converter, details["result"]) if "result" in details else None,
            "failure": await _failure(converter, m.failure) if m.HasField("failure") else None,
            "task": m.workflow_task_completed_event_id,
        }
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        s = event.activity_task_scheduled_event_attributes
        return {
            "activity_type": s.activity_type.name,
            "activity_id": s.activity_id,
            "input": await _first(converter, s.input),
            "task_queue": s.task_queue.name,
        }
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
        st = event.activity_task_started_event_attributes
        return {
            "scheduled_event_id": st.scheduled_event_id,
            "attempt": st.attempt,
            "last_failure": await _failure(converter, st.last_failure)
            if st.HasField("last_failure")
            else None,
        }
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        c = event.activity_task_completed_event_attributes
        return {
            "scheduled_event_id": c.scheduled_event_id,
            "result": await _first(converter, c.result),
        }
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
        f = event.activity_task_failed_event_attributes
        return {
            "scheduled_event_id": f.scheduled_event_id,
            "failure": await _failure(converter, f.failure),
        }
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
        t = event.activity_task_timed_out_event_attributes
        return {
            "scheduled_event_id": t.scheduled_event_id,
            "failure": await _failure(converter, t.failure),
        }
    if kind == EventType.EVENT_TYPE_TIMER_STARTED:
        ts = event.timer_started_event_attributes
        return {
            "timer_id": ts.timer_id,
            "start_to_fire_ms": ts.start_to_fire_timeout.ToTimedelta() / timedelta(milliseconds=1),
        }
    if kind == EventType.EVENT_TYPE_TIMER_FIRED:
        return {"timer_id": event.timer_fired_event_attributes.timer_id}
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
        request = event.workflow_execution_update_accepted_event_attributes.accepted_request
        return {
            "name": request.input.name,
            "args": await _values(converter, request.input.args),
        }
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
        sig = event.workflow_execution_signaled_event_attributes
        return {"name": sig.signal_name, "args": await _values(converter, sig.input)}
    if kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
        child = event.start_child_workflow_execution_initiated_event_attributes
        return {
            "workflow_type": child.workflow_type.name,
            "workflow_id": child.workflow_id,
            "input": await _first(converter, child.input),
        }
    if kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED:
        failed = event.start_child_workflow_execution_failed_event_attributes
        return {"workflow_type": failed.workflow_type.name, "cause": str(failed.cause)}
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
        done = event.workflow_execution_completed_event_attributes
        return {"result": await _first(converter, done.result)}
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
        wf = event.workflow_execution_failed_event_attributes
        return {"failure": await _failure(converter, wf.failure)}
    if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED:
        return {"reason": event.workflow_execution_terminated_event_attributes.reason}
    if kind in (
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT,
    ):
        return {}
    return None
