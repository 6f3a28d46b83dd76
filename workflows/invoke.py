"""InvokeWorkflow: one durable request, keyed by its RequestID (workflow id = request_id).

Resolve an instance, call it through its connector, wait for a late answer if the agent accepted
the request (202), and deliver the callback if the caller gave one. The deadline (`deadline_ms`,
fixed at acceptance) bounds every step. After a failure the workflow asks `reach.policy.next_step`
whether to try again (after a durable timer, on another instance) or to report.

In `inline` mode resolve and call run as local activities inside the first workflow task (the
fast path); in `queue` mode they run on task queue `reach-cap-<capability>`, served by
`worker.py --capability <capability>`.
"""

from __future__ import annotations

import builtins
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    TimeoutError,
    TimeoutType,
)

with workflow.unsafe.imports_passed_through():
    from reach.invocation import (
        ACTIVITY_CALL,
        ACTIVITY_DELIVER_CALLBACK,
        ACTIVITY_RESOLVE,
        SIGNAL_LATE_ANSWER,
        CallbackInput,
        CallInput,
        Endpoint,
        InvokeInput,
        LateAnswer,
        ResolveInput,
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


SA_CALLER = SearchAttributeKey.for_keyword("ReachCaller")
SA_CAPABILITY = SearchAttributeKey.for_keyword("ReachCapability")
SA_OPERATION = SearchAttributeKey.for_keyword("ReachOperation")
SA_STATUS = SearchAttributeKey.for_keyword("ReachStatus")
SA_INSTANCE = SearchAttributeKey.for_keyword("ReachInstance")
SEARCH_ATTRIBUTES = (SA_CALLER, SA_CAPABILITY, SA_OPERATION, SA_STATUS, SA_INSTANCE)

ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)


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
        retryable = bool(details.get("retryable")) if isinstance(details, dict) else False
        info = ErrorInfo(
            type=cause.type or "agent_error", message=cause.message, retryable=retryable
        )
    else:
        info = ErrorInfo(type="agent_error", message=str(cause or exc), retryable=False)
    return _Failed(info, instance_id)


@workflow.defn(name="InvokeWorkflow")
class InvokeWorkflow:
    def __init__(self) -> None:
        self._late: LateAnswer | None = None

    @workflow.signal(name=SIGNAL_LATE_ANSWER)
    def late_answer(self, answer: LateAnswer) -> None:
        # The first answer wins; a re-sent answer must not change what the caller got.
        if self._late is None:
            self._late = answer

    @workflow.run
    async def run(self, inp: InvokeInput) -> InvokeResponse:
        response = await self._invoke(inp)
        workflow.upsert_search_attributes(
            [SA_STATUS.value_set(response.status)]
            + ([SA_INSTANCE.value_set(response.instance_id)] if response.instance_id else [])
        )
        if inp.callback:
            await self._deliver(inp, inp.callback, response)
        return response

    async def _deliver(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        plan = inp.callback_plan
        try:
            await workflow.execute_activity(
                ACTIVITY_DELIVER_CALLBACK,
                CallbackInput(url=url, response=response),
                start_to_close_timeout=timedelta(seconds=plan.attempt_timeout_s),
                schedule_to_close_timeout=timedelta(seconds=plan.retry_window_s),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=plan.initial_backoff_s),
                    maximum_interval=timedelta(seconds=plan.max_backoff_s),
                    backoff_coefficient=2.0,
                ),
            )
        except ActivityError as exc:
            # The result itself is not lost: it stays the workflow's result (GET
            # /reach/requests/{id}); the failed delivery is in the history for the operator.
            workflow.logger.warning("callback to %s not delivered: %s", url, exc.cause or exc)

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
            try:
                endpoint = await self._run(
                    inp,
                    ACTIVITY_RESOLVE,
                    ResolveInput(
                        capability=inp.target,
                        exclude=tried,
                        routing_key=inp.routing_key,
                        request_id=inp.request_id,
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
                if reply.status == "ok":
                    return self._envelope(
                        inp, "success", result=reply.result, instance_id=instance_id
                    )
                return await self._await_late_answer(inp, instance_id)
            except _Failed as failed:
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
        late = self._late
        assert late is not None
        if late.status == "success":
            return self._envelope(inp, "success", result=late.result or {}, instance_id=instance_id)
        error = ErrorInfo(
            type=late.error_type or "agent_error",
            message=late.error_message or "the agent reported a failure",
            retryable=False,
        )
        return self._envelope(inp, "error", error=error, instance_id=instance_id)
