"""Every call the door and the request reads make to Temporal, in one place.

Workflow id = RequestID, `REJECT_DUPLICATE` + `USE_EXISTING`: a request id never runs twice,
and a repeat attaches to the first run (DESIGN.md, "Temporal"). The steps and services take an
`Engine`, so each can be tested against a real dev server, or without one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    TerminatedError,
    WorkflowAlreadyStartedError,
)
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.service import RPCError, RPCStatusCode

from gateway_api.temporal_adapter import started_here
from reach.invocation import InvokeInput
from reach.listing import MEMO_CONTEXT
from reach.messages import ErrorInfo, InvokeResponse
from reach.outcome import carried
from workflows.invoke import (
    SA_CALLER,
    SA_CAPABILITY,
    SA_INSTANCE,
    SA_OPERATION,
    SA_STATUS,
    InvokeWorkflow,
)

InvokeHandle = WorkflowHandle[InvokeWorkflow, InvokeResponse]


class Engine:
    """The invoke workflows of one task queue, over one client."""

    def __init__(
        self,
        client: Client,
        task_queue: str,
        rpc_timeout: timedelta,
        task_timeout: timedelta | None = None,
    ) -> None:
        self.client = client
        self.task_queue = task_queue
        self.rpc_timeout = rpc_timeout
        # How long a workflow task may run before another worker gets it (None: Temporal's 10 s).
        self.task_timeout = task_timeout

    def handle(self, request_id: str) -> InvokeHandle:
        return self.client.get_workflow_handle_for(InvokeWorkflow.run, request_id)

    async def start(self, inp: InvokeInput) -> tuple[InvokeHandle, bool]:
        """The handle, and whether this call started the workflow (False: it attached)."""
        try:
            handle = await self.client.start_workflow(
                InvokeWorkflow.run,
                inp,
                id=inp.request_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                request_eager_start=True,
                task_timeout=self.task_timeout,
                rpc_timeout=self.rpc_timeout,
                # The Temporal UI's one line per request; the workflow adds the outcome.
                static_summary=f"{inp.target}.{inp.operation} from {inp.caller}",
                # A request continuing a conversation says which in lists (ListTasks' contextId).
                memo={MEMO_CONTEXT: inp.context_id}
                if inp.context_id and inp.context_id != inp.request_id
                else None,
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(SA_CALLER, inp.caller),
                        SearchAttributePair(SA_CAPABILITY, inp.target),
                        SearchAttributePair(SA_OPERATION, inp.operation),
                        SearchAttributePair(SA_STATUS, inp.status_at_start),
                    ]
                    + (
                        [SearchAttributePair(SA_INSTANCE, inp.endpoint.instance_id)]
                        if inp.endpoint is not None
                        else []
                    )
                ),
            )
        except WorkflowAlreadyStartedError:
            # Finished earlier: attach to it; a request id never runs twice.
            return self.handle(inp.request_id), False
        return handle, started_here(handle)

    async def exists(self, request_id: str) -> bool:
        try:
            await self.client.get_workflow_handle(request_id).describe(rpc_timeout=self.rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def cancel(self, request_id: str, reason: str) -> None:
        """Ask a request's workflow to stop (Temporal's workflow cancel, with `reason` in its
        history); it then ends at its next step, and reads as cancelled (`was_cancelled`).
        `RPCError` NOT_FOUND: no such request, or it had already closed."""
        await self.handle(request_id).cancel(reason=reason, rpc_timeout=self.rpc_timeout)

    async def original(self, handle: WorkflowHandle[Any, Any]) -> InvokeInput | None:
        """The request as it was accepted: its workflow's input, from the first history event.

        Read only off the hot path (repeats and look-ups); a memo would carry the same on every
        start and measurably slows it.
        """
        async for event in handle.fetch_history_events(page_size=1, rpc_timeout=self.rpc_timeout):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            try:
                [inp] = await self.client.data_converter.decode(payloads, [InvokeInput])
            except Exception:  # an input nobody can decode: the request reads as failed
                return None
            return inp if isinstance(inp, InvokeInput) else None
        return None

    async def outcome(
        self, handle: InvokeHandle, rpc_timeout: timedelta | None = None
    ) -> InvokeResponse:
        """The request's final envelope, also when its workflow ended without one.

        `rpc_timeout` for a workflow known to be closed; a caller waiting for a running one
        bounds the wait itself (the result is a long poll).
        """
        try:
            return await handle.result(rpc_timeout=rpc_timeout)
        except WorkflowFailureError as exc:
            # An error or timeout fails its workflow, the envelope in the failure (reach.outcome).
            return failed_outcome(exc.cause) or ended_without_result(handle.id, exc.cause)

    async def ended_without_result(self, handle: InvokeHandle) -> InvokeResponse | None:
        """The envelope of a run that closed without its verdict (terminated, cancelled,
        timed out, failed in Reach); None while it runs or once it had one (completed, or
        failed carrying its error or timeout). Asked of repeats only."""
        desc = await handle.describe(rpc_timeout=self.rpc_timeout)
        if desc.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED):
            return None
        try:
            await handle.result(rpc_timeout=self.rpc_timeout)
        except WorkflowFailureError as exc:
            if failed_outcome(exc.cause) is not None:
                return None
            return ended_without_result(handle.id, exc.cause)
        return None

    async def decode(self, payload: Payload) -> InvokeResponse:
        """The final envelope from the result payload its workflow completed with."""
        (response,) = await self.client.data_converter.decode([payload], [InvokeResponse])
        if not isinstance(response, InvokeResponse):
            raise TypeError(f"the invoke workflow's result is a {type(response).__name__}")
        return response


CLOSED_BEFORE_RESULT = " before it had a result: "


def was_cancelled(response: InvokeResponse) -> bool:
    """Whether this envelope is that of a request whose workflow was cancelled (by an operator,
    or an A2A client's CancelTask) before it had a result."""
    error = response.error
    return (
        error is not None
        and error.type == "request_closed"
        and error.message.startswith(f"the request was cancelled{CLOSED_BEFORE_RESULT}")
    )


def failed_outcome(cause: BaseException | None) -> InvokeResponse | None:
    """The envelope a workflow failed with for its error or timeout (`reach.outcome`); None for
    any other failure."""
    if isinstance(cause, ApplicationError):
        return carried(cause.type, cause.details)
    return None


def ended_without_result(request_id: str, cause: BaseException | None) -> InvokeResponse:
    """A typed, final envelope for a request whose workflow ended without producing one."""
    show = f"`temporal workflow show --workflow-id {request_id}` tells why"
    if isinstance(cause, TemporalTimeout):
        return InvokeResponse(
            request_id=request_id,
            status="timeout",
            error=ErrorInfo(
                type="timeout",
                message=f"the request's workflow was ended by a timeout set outside Reach; {show}",
            ),
        )
    if isinstance(cause, TerminatedError | CancelledError):
        # Not Reach's failure (a 500): an operator closed the request before it had a result.
        # A cancel's reason names who asked (an operator, an A2A client's CancelTask).
        what = "terminated by an operator" if isinstance(cause, TerminatedError) else "cancelled"
        return InvokeResponse(
            request_id=request_id,
            status="error",
            error=ErrorInfo(
                type="request_closed",
                message=f"the request was {what}{CLOSED_BEFORE_RESULT}"
                f"{cause.message or 'no reason given'}; {show}",
            ),
        )
    message = f"the request failed inside Reach: {cause}; {show}"
    return InvokeResponse(
        request_id=request_id, status="error", error=ErrorInfo(type="internal", message=message)
    )
