"""Step 9, start: the durable workflow keyed by the RequestID, or the earlier run it repeats.

A repeat (the RequestID exists) attaches to the first request, only if it asks the same:
same body and caller (409 otherwise); it may drop the callback and wait for the result
instead, but never add or change one. A RequestID belongs to the caller that first used it:
another caller's repeat is refused 409 saying only that the id is taken (`RequestIdTaken`,
audited as `request_id_taken`), never whose it is, its state or its result.

A start whose answer is lost (the RPC timed out, the connection broke) may have started the
workflow all the same. The door then asks whether it exists: if it does, the request goes on
as started; if it does not, the refusal is a plain 503 that means "not started"; if Temporal
cannot say, the 503 carries `outcome_unknown` and tells the caller to ask by RequestID (a
repeat with the same request_id is always safe: it never runs twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio.service import RPCError, RPCStatusCode

from gateway_api.engine import Engine, InvokeHandle
from gateway_api.steps.identify import Identity
from reach.errors import RequestConflict, Unavailable
from reach.invocation import CallbackPlan, CallPlan, Endpoint, InvokeInput, same_request
from reach.messages import InvokeRequest
from reach.telemetry import tracing


def invoke_input(
    request: InvokeRequest,
    identity: Identity,
    plan: CallPlan,
    *,
    now_ms: int,
    payload_bytes: int,
    hash_key: str | None,
    endpoint: Endpoint | None,
    callback_plan: CallbackPlan,
) -> InvokeInput:
    """The workflow's input: everything the request's run needs, decided here once."""
    assert request.request_id is not None
    return InvokeInput(
        request_id=request.request_id,
        caller=identity.caller,
        target=request.target,
        operation=request.operation,
        payload=request.payload,
        accepted_at_ms=now_ms,
        deadline_ms=now_ms + plan.timeout_ms,
        callback=str(request.callback) if request.callback else None,
        callback_plan=callback_plan,
        idempotency_key=request.idempotency_key,
        routing_key=request.routing_key,
        hash_key=hash_key,
        traceparent=_traceparent(identity),
        context_id=request.context_id,
        plan=plan,
        payload_bytes=payload_bytes,
        endpoint=endpoint,
        # What nearly every such request ends as: then its end writes no search attribute (a
        # running request reads as running whatever it says: reach.listing.status_of).
        status_at_start="success" if endpoint is not None and plan.mode == "inline" else "running",
    )


def _traceparent(identity: Identity) -> str | None:
    """What the call's header carries: with tracing on, the front's SERVER span (current
    here), which the connector's span continues in whichever worker calls the agent; off, the
    caller's, passed on unchanged."""
    if tracing.tracer is not None:
        return tracing.current_traceparent() or identity.traceparent
    return identity.traceparent


@dataclass(slots=True)
class Started:
    handle: InvokeHandle
    started: bool  # False: attached to an earlier run of the same RequestID
    deadline_ms: int  # the first request's, for a repeat


# Answers after which the start may or may not have happened.
UNCLEAR = frozenset(
    {
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.CANCELLED,
        RPCStatusCode.UNKNOWN,
        RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.INTERNAL,
    }
)


async def start(engine: Engine, inp: InvokeInput) -> Started:
    try:
        handle, started = await engine.start(inp)
    except RPCError as exc:
        if exc.status not in UNCLEAR:
            raise
        handle, started = await _after_an_unclear_start(engine, inp.request_id, exc), False
    deadline_ms = inp.deadline_ms
    if not started:
        # A repeat (rare): the first request's own input says what it was.
        first = await engine.original(handle)
        if first is not None:
            check_repeat(inp.request_id, first, inp)
            deadline_ms = first.deadline_ms
    return Started(handle, started, deadline_ms)


async def _after_an_unclear_start(
    engine: Engine, request_id: str, failure: RPCError
) -> InvokeHandle:
    """The run a start may have made; the original failure when it surely made none."""
    try:
        exists = await engine.exists(request_id)
    except RPCError:
        raise Unavailable(
            f"the workflow engine did not answer whether request {request_id!r} started "
            f"({failure.status.name}: {failure.message}); it may run: "
            f"GET /reach/requests/{request_id} tells, and a repeat with the same request_id "
            "never runs it twice",
            outcome_unknown=True,
        ) from failure
    if not exists:
        raise failure
    return engine.handle(request_id)


class RequestIdTaken(RequestConflict):
    """A RequestID another caller holds (a 409 `request_conflict` that says nothing more)."""


def check_repeat(request_id: str, first: InvokeInput, repeat: InvokeInput) -> None:
    """A repeated RequestID attaches only to the same caller's same request; it may drop the
    callback (and wait for the result instead) but never add or change one."""
    if first.caller != repeat.caller:
        raise RequestIdTaken(
            f"request_id {request_id!r} is taken; send the request with a new request_id, or "
            "with none (Reach then gives it one)"
        )
    read_it = f"GET /reach/requests/{request_id} reads the first one"
    if not same_request(first, repeat):
        raise RequestConflict(
            f"request_id {request_id!r} was first used with another body; repeat "
            f"the request exactly or use a new request_id ({read_it})"
        )
    if repeat.callback and repeat.callback != first.callback:
        was = f"with callback {first.callback}" if first.callback else "without a callback"
        raise RequestConflict(
            f"request {request_id!r} was accepted {was}; a repeat cannot change where its "
            f"result goes ({read_it})"
        )
