"""What the routes call: start/attach invoke workflows, read their state, pass late answers.

Orchestration itself is never here (that is the workflow's job); this module only talks to
Temporal and the registry on behalf of one HTTP request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

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
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from reach.config import ReachSettings
from reach.errors import (
    InternalError,
    PayloadTooLarge,
    RequestClosed,
    UnknownCapability,
    UnknownRequest,
)
from reach.invocation import SIGNAL_LATE_ANSWER, CallbackPlan, InvokeInput, LateAnswer
from reach.messages import (
    ErrorInfo,
    InvokeRequest,
    InvokeResponse,
    json_size,
    new_request_id,
)
from reach.policy import plan_call
from reach.registry import Registry
from workflows.invoke import (
    SA_CALLER,
    SA_CAPABILITY,
    SA_INSTANCE,
    SA_OPERATION,
    SA_STATUS,
    InvokeWorkflow,
)

log = logging.getLogger("reach.gateway")

# How long past its deadline a synchronous caller waits for the workflow's own verdict.
SYNC_GRACE_S = 5.0


@dataclass
class Gateway:
    settings: ReachSettings
    client: Client
    registry: Registry

    async def invoke(
        self, req: InvokeRequest, caller: str, traceparent: str | None = None
    ) -> InvokeResponse:
        request_id = req.request_id or new_request_id()
        limit = self.settings.transport.max_message_bytes
        size = json_size(req.payload)
        if size > limit:
            raise PayloadTooLarge(f"payload is {size} bytes; the limit is {limit}")
        if not await self.registry.known(req.target) and not await self._exists(request_id):
            raise UnknownCapability(f"no agent has ever registered capability {req.target!r}")
        plan = plan_call(
            self.settings.policy,
            capability=req.target,
            operation=req.operation,
            timeout_ms=req.timeout_ms,
            idempotency_key=req.idempotency_key,
            mode=self.settings.capability_mode(req.target),
        )
        now_ms = int(time.time() * 1000)
        cb = self.settings.callback
        inp = InvokeInput(
            request_id=request_id,
            caller=caller,
            target=req.target,
            operation=req.operation,
            payload=req.payload,
            accepted_at_ms=now_ms,
            deadline_ms=now_ms + plan.timeout_ms,
            callback=str(req.callback) if req.callback else None,
            callback_plan=CallbackPlan(**cb.model_dump()),
            idempotency_key=req.idempotency_key,
            routing_key=req.routing_key,
            traceparent=traceparent,
            plan=plan,
            payload_bytes=size,
        )
        handle = await self._start(inp)
        if req.callback:
            return InvokeResponse(request_id=request_id, status="accepted")
        try:
            return await asyncio.wait_for(
                self._result(handle), timeout=plan.timeout_ms / 1000 + SYNC_GRACE_S
            )
        except TimeoutError:
            return InvokeResponse(
                request_id=request_id,
                status="timeout",
                duration_ms=int(time.time() * 1000) - now_ms,
                error=ErrorInfo(
                    type="timeout",
                    message="no verdict within the deadline; the request is still tracked: "
                    f"GET /reach/requests/{request_id}",
                ),
            )

    async def _start(self, inp: InvokeInput) -> WorkflowHandle[InvokeWorkflow, InvokeResponse]:
        try:
            return await self.client.start_workflow(
                InvokeWorkflow.run,
                inp,
                id=inp.request_id,
                task_queue=self.settings.temporal.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                request_eager_start=True,
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(SA_CALLER, inp.caller),
                        SearchAttributePair(SA_CAPABILITY, inp.target),
                        SearchAttributePair(SA_OPERATION, inp.operation),
                        SearchAttributePair(SA_STATUS, "running"),
                    ]
                ),
            )
        except WorkflowAlreadyStartedError:
            # Finished earlier: attach to it; a request id never runs twice.
            return self.client.get_workflow_handle_for(InvokeWorkflow.run, inp.request_id)

    async def _result(
        self, handle: WorkflowHandle[InvokeWorkflow, InvokeResponse]
    ) -> InvokeResponse:
        try:
            return await handle.result()
        except WorkflowFailureError as exc:
            raise InternalError(f"request {handle.id} ended without a result: {exc.cause}") from exc

    async def _exists(self, request_id: str) -> bool:
        try:
            await self.client.get_workflow_handle(request_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def status(self, request_id: str) -> InvokeResponse:
        handle = self.client.get_workflow_handle_for(InvokeWorkflow.run, request_id)
        try:
            desc = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise UnknownRequest(f"no request with id {request_id!r}") from exc
            raise
        if desc.status == WorkflowExecutionStatus.RUNNING:
            return InvokeResponse(
                request_id=request_id,
                status="running",
                instance_id=desc.typed_search_attributes.get(SA_INSTANCE),
            )
        return await self._result(handle)

    async def late_answer(self, request_id: str, answer: LateAnswer) -> None:
        limit = self.settings.transport.max_message_bytes
        if answer.result is not None and json_size(answer.result) > limit:
            raise PayloadTooLarge(f"result is larger than the limit of {limit} bytes")
        handle = self.client.get_workflow_handle(request_id)
        try:
            await handle.signal(SIGNAL_LATE_ANSWER, answer)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if await self._exists(request_id):
                raise RequestClosed(
                    f"request {request_id!r} is already finished; its result is final"
                ) from exc
            raise UnknownRequest(f"no request with id {request_id!r}") from exc
        log.info("late answer request=%s status=%s", request_id, answer.status)
