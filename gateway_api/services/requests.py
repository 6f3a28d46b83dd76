"""Reading a request (status, its callback delivery) and handing it an agent's late answer.

With tokens required only a request's caller (or an admin) may read it; anyone else is told
it does not exist (a 403 would confirm that it does).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.failure.v1 import Failure
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from gateway_api.engine import Engine, InvokeHandle
from reach.errors import Forbidden, InvalidRequest, RequestClosed, Unavailable, UnknownRequest
from reach.invocation import (
    DeliveryOutcome,
    InvokeInput,
    LateAnswer,
    answer_key,
    delivery_workflow_id,
)
from reach.listing import UNDER_WAY
from reach.messages import AttemptInfo, DeliveryState, InvokeResponse
from reach.registry import Registry
from reach.security.guard import Guard
from reach.security.redact import safe_url
from reach.security.tokens import Principal
from workflows.invoke import SA_CALLER, SA_INSTANCE, InvokeWorkflow

log = logging.getLogger("reach.gateway")

# How long a status look-up waits for a running request's worker to list its attempts.
QUERY_WAIT = timedelta(seconds=1)


class Requests:
    def __init__(self, engine: Engine, registry: Registry, guard: Guard | None = None) -> None:
        self.engine = engine
        self.registry = registry
        self.guard = guard

    async def status(self, request_id: str, principal: Principal | None = None) -> InvokeResponse:
        """A request's state, and its callback delivery's when it has a callback."""
        return (await self.looked(request_id, principal))[0]

    async def looked(
        self, request_id: str, principal: Principal | None = None
    ) -> tuple[InvokeResponse, InvokeInput | None]:
        """`status`, and the request as it was accepted (None: unreadable), read for it."""
        engine = self.engine
        handle = engine.handle(request_id)
        try:
            desc = await handle.describe(rpc_timeout=engine.rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise UnknownRequest(f"no request with id {request_id!r}") from exc
            raise
        owner = desc.typed_search_attributes.get(SA_CALLER)
        if principal is not None and principal.kind != "admin" and owner != principal.name:
            if self.guard is not None:  # a look at another caller's request: audited
                self.guard.audit.record(
                    "request_read_refused",
                    request_id=request_id,
                    principal=principal.name,
                    status=404,
                    error_type="unknown_request",
                )
            raise UnknownRequest(f"no request with id {request_id!r}")
        if desc.status == WorkflowExecutionStatus.RUNNING:
            response = InvokeResponse(
                request_id=request_id,
                status="running",
                instance_id=desc.typed_search_attributes.get(SA_INSTANCE),
                # A query waits for the workflow task in progress (an inline call): skip it then.
                attempts=None
                if desc.raw_description.HasField("pending_workflow_task")
                else await self._attempts_so_far(handle),
            )
        else:
            response = await engine.outcome(handle, engine.rpc_timeout)
        original = await engine.original(handle)
        if original is not None and original.callback:
            response.delivery = await self._delivery(request_id, original.callback, response.status)
        return response, original

    async def _attempts_so_far(self, handle: InvokeHandle) -> list[AttemptInfo] | None:
        """A running request's attempts, asked of its worker; none when no worker answers soon
        (a query needs one), which must not hold up the status itself."""
        try:
            attempts = await handle.query(InvokeWorkflow.attempts_so_far, rpc_timeout=QUERY_WAIT)
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
            return None
        return attempts or None

    async def _words_of(self, failure: Failure) -> str | None:
        """A failure's message, decoded first (with encryption on its message travels
        encoded, and reads "Encoded failure" as it is)."""
        copy = Failure()
        copy.CopyFrom(failure)
        try:
            return str(await self.engine.client.data_converter.decode_failure(copy)) or None
        except Exception:
            return failure.message or None

    async def _delivery(self, request_id: str, url: str, status: str) -> DeliveryState:
        """The callback delivery's state, from its own workflow (its URL as `safe_url`
        shows it: no credentials or query in an answer)."""
        url = safe_url(url)
        rpc_timeout = self.engine.rpc_timeout
        handle = self.engine.client.get_workflow_handle(
            delivery_workflow_id(request_id), result_type=DeliveryOutcome
        )
        try:
            desc = await handle.describe(rpc_timeout=rpc_timeout)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if status == "running":  # the result is not known yet
                return DeliveryState(url=url, status="pending")
            return DeliveryState(
                url=url,
                status="given_up",
                last_error=f"the request ended ({status}) before a worker could hand its "
                "result to delivery",
            )
        if desc.status == WorkflowExecutionStatus.RUNNING:
            attempts, last_error = 0, None
            for pending in desc.raw_description.pending_activities:
                waiting = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
                attempts = pending.attempt - 1 if waiting else pending.attempt
                if pending.HasField("last_failure"):
                    last_error = await self._words_of(pending.last_failure)
            return DeliveryState(
                url=url, status="pending", attempts=attempts, last_error=last_error
            )
        try:
            outcome: DeliveryOutcome = await handle.result(rpc_timeout=rpc_timeout)
        except WorkflowFailureError as exc:
            return DeliveryState(url=url, status="given_up", last_error=str(exc.cause))
        return DeliveryState(url=url, **outcome.model_dump())

    async def cancel(
        self,
        request_id: str,
        principal: Principal | None,
        *,
        front: str,
        reason: str,
        wait_s: float,
    ) -> tuple[bool, InvokeResponse]:
        """Ask a request under way (its caller's or, for an admin, anyone's) to stop: audited
        `cancel_requested`, then its end waited for up to `wait_s` (the workflow stops at its
        next step and ends `canceled`, `workflows._failures`). Returns whether it was under way
        (False: it had already ended, and nothing was asked) and its state then; `reason` is
        the cancel's, as Temporal keeps it (who asked, through which front)."""
        current = await self.status(request_id, principal)
        if current.status not in UNDER_WAY:
            return False, current
        if self.guard is not None:
            who = principal.name if principal is not None else None
            self.guard.audit.record(
                "cancel_requested", request_id=request_id, principal=who, front=front
            )
        engine = self.engine
        try:
            await engine.cancel(request_id, reason)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        try:
            async with asyncio.timeout(wait_s):
                return True, await engine.outcome(engine.handle(request_id))
        except TimeoutError:  # no worker took the cancel yet: it stays requested
            return True, await self.status(request_id, principal)

    async def late_answer(
        self, request_id: str, answer: LateAnswer, principal: Principal | None = None
    ) -> str:
        """Hand an agent's late answer to its request: 'received' (also for a resend of it).

        The update's id is the answer's content, so a resend (after a 503, a lost reply) is the
        same update, never another one carrying the same payload again. An answer refused as
        not this principal's to give (403) is audited (`answer_refused`): a forgery try.
        """
        try:
            return await self._late_answer(request_id, answer, principal)
        except Forbidden as exc:
            if self.guard is not None:
                self.guard.audit.record(
                    "answer_refused",
                    request_id=request_id,
                    principal=principal.name if principal else None,
                    instance=answer.instance_id,
                    status=exc.http_status,
                    error_type=exc.type,
                    reason=exc.message,
                )
            raise

    async def _late_answer(
        self, request_id: str, answer: LateAnswer, principal: Principal | None
    ) -> str:
        answer.principal = None
        if principal is not None and principal.kind == "agent":
            # Only the instance the request was sent to answers it: here, the principal must
            # hold that instance now; the workflow checks it sent the request to an instance
            # this principal registered.
            if answer.instance_id is None:
                raise InvalidRequest("instance_id: required in a late answer when tokens are on")
            if await self.registry.owned(answer.instance_id, principal.name) is None:
                raise Forbidden(
                    f"instance {answer.instance_id!r} is not registered; join again, then answer"
                )
            answer.principal = principal.name
        handle = self.engine.handle(request_id)
        # Twice the RPC timeout: the update waits for a worker to run its validator.
        wait = 2 * self.engine.rpc_timeout
        try:
            verdict = await handle.execute_update(
                InvokeWorkflow.submit_late_answer,
                answer,
                id=f"late-answer-{answer_key(answer)}",
                rpc_timeout=wait,
            )
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == "duplicate":
                return "received"
            if isinstance(cause, ApplicationError) and cause.type == "not_yet":
                # A worker is taking the request over: it knows whom it was sent in a moment.
                raise Unavailable(
                    f"request {request_id!r}: {cause.message}", retry_after_s=1
                ) from exc
            if isinstance(cause, ApplicationError) and cause.type == "forbidden":
                raise Forbidden(f"request {request_id!r}: {cause.message}") from exc
            reason = cause.message if isinstance(cause, ApplicationError) else str(exc)
            raise RequestClosed(f"request {request_id!r}: {reason}") from exc
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            raise Unavailable(
                f"no worker took the answer for {request_id!r} within "
                f"{wait.total_seconds():.0f}s; send it again"
            ) from None
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if not await self.engine.exists(request_id):
                raise UnknownRequest(f"no request with id {request_id!r}") from exc
            return await self._answer_after_the_end(handle, answer)
        log.info("late answer request=%s status=%s", request_id, answer.status)
        return verdict

    async def _answer_after_the_end(self, handle: InvokeHandle, answer: LateAnswer) -> str:
        final = await self.engine.outcome(handle, self.engine.rpc_timeout)
        if made_the_result(answer, final):
            return "received"  # the answer that made the result, sent again
        raise RequestClosed(
            f"request {handle.id!r} already ended ({final.status}); its result is final"
        )


def made_the_result(answer: LateAnswer, final: InvokeResponse) -> bool:
    """Whether `final` is what this late answer, taken first, made of the request."""
    if answer.status == "success":
        return final.status == "success" and final.result == (answer.result or {})
    fault = final.error.agent if final.error else None
    return (
        final.status == "error"
        and fault is not None
        and fault.type == (answer.error_type or "agent_error")
        and fault.message == (answer.error_message or "the agent reported a failure")
    )
