"""InvokeWorkflow: one durable request, keyed by its RequestID (workflow id = request_id).

Resolve an instance, call it through its connector, wait for a late answer if the agent accepted
the request (202), and hand the result to a callback delivery if the caller gave one. The
deadline (`deadline_ms`, fixed at acceptance) bounds every step. After a failure the workflow
asks `reach.policy.next_step` whether to try again (after a durable timer, on another instance)
or to report.

The result is final as soon as it is known: the workflow completes with it, and a callback is
delivered by a workflow of its own (`DeliverCallbackWorkflow`, id `<request_id>/callback`), so a
receiver that is down for an hour never holds the request open. A payload this workflow cannot
decode fails it at once (a pydantic `ValidationError` is a workflow failure, not a task retried
forever), and any other exception in this code ends the request with a typed `internal` error:
no input can make a workflow task fail and retry forever. Without a worker, a request simply
waits (Temporal keeps it); when one returns, it ends by its own deadline, callback included.

In `inline` mode resolve and call run as local activities inside the first workflow task (the
fast path); in `queue` mode they run on task queue `reach-cap-<capability>`, served by
`worker.py --capability <capability>`.
"""

from __future__ import annotations

import builtins
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    TimeoutError,
    TimeoutType,
)

with workflow.unsafe.imports_passed_through():
    from reach.errors import ERROR_TYPES, AgentFault
    from reach.invocation import (
        ACTIVITY_CALL,
        ACTIVITY_RESOLVE,
        SIGNAL_LATE_ANSWER,
        UPDATE_LATE_ANSWER,
        WORKFLOW_INVOKE,
        CallbackInput,
        CallInput,
        Endpoint,
        InvokeInput,
        LateAnswer,
        ResolveInput,
        answer_key,
        delivery_workflow_id,
    )
    from reach.messages import (
        ErrorInfo,
        Header,
        InvokeResponse,
        Message,
        Metadata,
        Reply,
        RequestStatus,
    )
    from reach.policy import GiveUp, next_step
    from workflows.callback import DeliverCallbackWorkflow, deliver


SA_CALLER = SearchAttributeKey.for_keyword("ReachCaller")
SA_CAPABILITY = SearchAttributeKey.for_keyword("ReachCapability")
SA_OPERATION = SearchAttributeKey.for_keyword("ReachOperation")
SA_STATUS = SearchAttributeKey.for_keyword("ReachStatus")
SA_INSTANCE = SearchAttributeKey.for_keyword("ReachInstance")
SEARCH_ATTRIBUTES = (SA_CALLER, SA_CAPABILITY, SA_OPERATION, SA_STATUS, SA_INSTANCE)

ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)
# Requests accepted before callbacks had a workflow of their own deliver inline (replay only).
PATCH_DELIVERY_WORKFLOW = "callback-delivery-workflow"
# How long a callback delivery may outlive its retry window (the final attempt's own timeout).
DELIVERY_GRACE = timedelta(minutes=5)


def capability_queue(capability: str) -> str:
    return f"reach-cap-{capability}"


class _Failed(Exception):
    def __init__(self, error: ErrorInfo, instance_id: str | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.instance_id = instance_id


def _error_of(exc: FailureError, instance_id: str | None) -> _Failed:
    # Regular activities fail with ActivityError(cause=...); local ones with the cause itself.
    cause = exc.cause if isinstance(exc, ActivityError) else exc
    if isinstance(cause, TimeoutError):
        if cause.type == TimeoutType.HEARTBEAT:
            info = ErrorInfo(type="transport_error", message="worker lost mid-call", retryable=True)
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
        )
    else:
        info = ErrorInfo(type="internal", message=str(cause or exc), retryable=False)
    return _Failed(info, instance_id)


@workflow.defn(name=WORKFLOW_INVOKE, failure_exception_types=[ValidationError])
class InvokeWorkflow:
    def __init__(self) -> None:
        self._late: LateAnswer | None = None
        self._final: InvokeResponse | None = None

    @workflow.update(name=UPDATE_LATE_ANSWER)
    def submit_late_answer(self, answer: LateAnswer) -> str:
        self._late = answer
        return "received"

    @submit_late_answer.validator
    def _check_late_answer(self, answer: LateAnswer) -> None:
        # A refused update leaves no trace in history: re-sent or stray answers cost nothing.
        if self._late is not None:
            if answer_key(self._late) == answer_key(answer):  # the same words, sent again
                raise ApplicationError("this answer was already received", type="duplicate")
            raise ApplicationError(
                "another answer to this request was already received", type="request_closed"
            )
        if self._final is not None:
            raise ApplicationError(
                f"the request already ended ({self._final.status}); its result is final",
                type="request_closed",
            )

    @workflow.signal(name=SIGNAL_LATE_ANSWER)
    def late_answer(self, answer: LateAnswer) -> None:
        # Requests accepted before late answers were an update. The first answer wins.
        if self._late is None:
            self._late = answer

    @workflow.run
    async def run(self, inp: InvokeInput) -> InvokeResponse:
        try:
            response = await self._invoke(inp)
        except workflow.NondeterminismError:
            raise  # a code or deploy problem: its task is retried until the code is fixed
        except Exception as exc:
            # A bug, or an input no check foresaw: end with a typed result, never a workflow
            # task that fails and is retried forever.
            workflow.logger.exception("request failed inside Reach")
            response = self._envelope(
                inp,
                "error",
                error=ErrorInfo(
                    type="internal", message=f"the request failed inside Reach: {exc!r}"
                ),
            )
        self._final = response
        workflow.upsert_search_attributes(
            [SA_STATUS.value_set(response.status)]
            + ([SA_INSTANCE.value_set(response.instance_id)] if response.instance_id else [])
        )
        if inp.callback:
            if workflow.patched(PATCH_DELIVERY_WORKFLOW):
                try:
                    await self._hand_to_delivery(inp, inp.callback, response)
                except workflow.NondeterminismError:
                    raise
                except Exception:
                    # The result stands; the delivery reads given_up (GET /reach/requests/{id}).
                    workflow.logger.exception("callback delivery could not be started")
            else:
                await self._deliver(inp, inp.callback, response)
        return response

    async def _hand_to_delivery(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        """Start the callback's own workflow; it outlives this one (parent close: abandon)."""
        await workflow.start_child_workflow(
            DeliverCallbackWorkflow.run,
            CallbackInput(url=url, response=response, plan=inp.callback_plan),
            id=delivery_workflow_id(inp.request_id),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            # Each run of a request starts its delivery once, so a closed one already under this
            # id belongs to an earlier request that reused the RequestID after retention.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            execution_timeout=timedelta(seconds=inp.callback_plan.retry_window_s) + DELIVERY_GRACE,
        )

    async def _deliver(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        """Inline delivery: only for requests accepted before `PATCH_DELIVERY_WORKFLOW`."""
        await deliver(CallbackInput(url=url, response=response, plan=inp.callback_plan))

    def _now_ms(self) -> int:
        return int(workflow.now().timestamp() * 1000)

    def _envelope(
        self,
        inp: InvokeInput,
        status: RequestStatus,
        *,
        result: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
        instance_id: str | None = None,
    ) -> InvokeResponse:
        return InvokeResponse(
            request_id=inp.request_id,
            status=status,
            duration_ms=max(0, self._now_ms() - inp.accepted_at_ms),
            result=result,
            error=error,
            instance_id=instance_id,
        )

    def _timeout(self, inp: InvokeInput, instance_id: str | None) -> InvokeResponse:
        return self._envelope(
            inp,
            "timeout",
            error=ErrorInfo(
                type="timeout",
                message=f"no answer within timeout_ms={inp.plan.timeout_ms}",
                retryable=False,
            ),
            instance_id=instance_id,
        )

    async def _invoke(self, inp: InvokeInput) -> InvokeResponse:
        attempt = 1
        tried: list[str] = []
        while True:
            instance_id: str | None = None
            if self._late is not None:  # answered before (or between) attempts: nothing to call
                return self._answered_late(inp, tried[-1] if tried else None)
            try:
                endpoint = await self._run(
                    inp,
                    ACTIVITY_RESOLVE,
                    ResolveInput(
                        capability=inp.target,
                        exclude=tried,
                        routing_key=inp.routing_key,
                        request_id=inp.request_id,
                        payload_bytes=inp.payload_bytes,
                    ),
                    Endpoint,
                    None,
                )
                instance_id = endpoint.instance_id
                message = Message(
                    header=Header(
                        request_id=inp.request_id,
                        caller=inp.caller,
                        target=inp.target,
                        operation=inp.operation,
                        attempt=attempt,
                        deadline_ms=inp.deadline_ms,
                        idempotency_key=inp.idempotency_key,
                        traceparent=inp.traceparent,
                    ),
                    payload=inp.payload,
                    metadata=Metadata(size_bytes=inp.payload_bytes),
                )
                remaining = inp.deadline_ms - self._now_ms()
                reply = await self._run(
                    inp,
                    ACTIVITY_CALL,
                    CallInput(endpoint=endpoint, message=message, timeout_ms=max(1, remaining)),
                    Reply,
                    instance_id,
                )
                if self._late is not None:
                    # Acknowledged while the call was still out: that answer came first.
                    return self._answered_late(inp, instance_id)
                if reply.status == "ok":
                    return self._envelope(
                        inp, "success", result=reply.result, instance_id=instance_id
                    )
                return await self._await_late_answer(inp, instance_id)
            except _Failed as failed:
                if self._late is not None:
                    return self._answered_late(inp, failed.instance_id)
                if failed.error.type == "timeout":
                    return self._timeout(inp, failed.instance_id)
                step = next_step(
                    inp.plan,
                    attempt=attempt,
                    retryable=failed.error.retryable,
                    failed_instance=failed.instance_id,
                    now_ms=self._now_ms(),
                    deadline_ms=inp.deadline_ms,
                )
                if isinstance(step, GiveUp):
                    workflow.logger.info("giving up after attempt %d: %s", attempt, step.reason)
                    return self._envelope(
                        inp, "error", error=failed.error, instance_id=failed.instance_id
                    )
                workflow.logger.info(
                    "attempt %d failed (%s); retrying in %.1fs",
                    attempt,
                    failed.error.type,
                    step.delay_s,
                )
                if step.avoid_instance:
                    tried.append(step.avoid_instance)
                await workflow.sleep(step.delay_s)
                attempt += 1

    async def _run(
        self,
        inp: InvokeInput,
        name: str,
        arg: Any,
        result_type: type[Any],
        instance_id: str | None,
    ) -> Any:
        remaining = inp.deadline_ms - self._now_ms()
        if remaining <= 0:
            raise _Failed(
                ErrorInfo(type="timeout", message="deadline reached", retryable=False), instance_id
            )
        budget = timedelta(milliseconds=remaining)
        try:
            if inp.plan.mode == "queue":
                return await workflow.execute_activity(
                    name,
                    arg,
                    result_type=result_type,
                    task_queue=capability_queue(inp.target),
                    schedule_to_close_timeout=budget,
                    heartbeat_timeout=timedelta(seconds=10) if name == ACTIVITY_CALL else None,
                    retry_policy=ONE_ATTEMPT,
                )
            return await workflow.execute_local_activity(
                name,
                arg,
                result_type=result_type,
                schedule_to_close_timeout=budget,
                retry_policy=ONE_ATTEMPT,
            )
        except (ActivityError, ApplicationError, TimeoutError) as exc:
            raise _error_of(exc, instance_id) from exc

    async def _await_late_answer(self, inp: InvokeInput, instance_id: str) -> InvokeResponse:
        remaining = inp.deadline_ms - self._now_ms()
        try:
            await workflow.wait_condition(
                lambda: self._late is not None, timeout=timedelta(milliseconds=max(1, remaining))
            )
        except builtins.TimeoutError:
            return self._timeout(inp, instance_id)
        return self._answered_late(inp, instance_id)

    def _answered_late(self, inp: InvokeInput, instance_id: str | None) -> InvokeResponse:
        """The request's result from the late answer the workflow acknowledged (the first)."""
        late = self._late
        assert late is not None
        if late.status == "success":
            return self._envelope(inp, "success", result=late.result or {}, instance_id=instance_id)
        # The agent's words go inside an agent_error; they never choose the caller's status.
        words = late.error_message or "the agent reported a failure"
        error = ErrorInfo(
            type="agent_error",
            message=f"agent {instance_id} answered late with an error: {words}",
            retryable=False,
            agent=AgentFault(type=late.error_type or "agent_error", message=words),
        )
        return self._envelope(inp, "error", error=error, instance_id=instance_id)
