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
        ACTIVITY_CLAIM_KEY,
        ACTIVITY_FOLLOW,
        ACTIVITY_RELEASE_KEY,
        ACTIVITY_RELEASE_ROUTE,
        ACTIVITY_RESOLVE,
        ACTIVITY_TAKE_TOKEN,
        SIGNAL_LATE_ANSWER,
        STALE_ROUTE,
        UPDATE_LATE_ANSWER,
        WORKFLOW_INVOKE,
        CallbackInput,
        CallInput,
        CallPlan,
        ClaimInput,
        ClaimOutcome,
        Endpoint,
        FollowInput,
        InvokeInput,
        LateAnswer,
        ResolveInput,
        TakeInput,
        answer_key,
        delivery_workflow_id,
        idempotency_scope,
        payload_fingerprint,
        pin_of,
    )
    from reach.messages import (
        AttemptInfo,
        ErrorInfo,
        Header,
        InvokeResponse,
        Message,
        Metadata,
        Reply,
        RequestStatus,
    )
    from reach.policy import GiveUp, next_step, refine_plan
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
QUERY_ATTEMPTS = "attempts"
# Requests accepted before idempotency keys were claimed in the store skip the claim (replay).
PATCH_IDEMPOTENCY_CLAIM = "idempotency-key-claim"
# Requests accepted before a broken call was re-delivered to its instance retried elsewhere.
PATCH_REDELIVER = "redeliver-same-attempt"
MAX_REDELIVERIES = 3
# A queued request checks for a token at most this far apart.
QUEUE_POLL_MAX_S = 60.0
REDELIVER_FIRST_S = 0.5
# Requests accepted before a store outage at routing was waited out give up as they did then.
PATCH_STORE_OUTAGE_WAIT = "store-outage-wait"
# Errors that end a request before any agent was sent it: its idempotency key is freed.
NOTHING_SENT = frozenset(
    {"no_instance", "circuit_open", "rate_limited", "payload_too_large", "unknown_capability"}
)
# A workflow's history when its first task runs: started, task scheduled, task started. More
# means an earlier task ran (and may have sent the call) and was lost with its worker.
FIRST_TASK_EVENTS = 3
# Store steps (claims, tokens) are quick; this bounds one that is not. One that fails because
# the store is away is tried again after 0.5 s, 1 s, 2 s... (at most 10 s apart).
STORE_STEP = timedelta(seconds=10)
STORE_RETRY_FIRST_S = 0.5
STORE_RETRY_MAX_S = 10.0
# How long freeing an idempotency key keeps trying (it expires on its own anyway).
RELEASE_WINDOW_MS = 60_000
# How long a callback delivery may outlive its retry window (the final attempt's own timeout).
DELIVERY_GRACE = timedelta(minutes=5)


def capability_queue(capability: str) -> str:
    return f"reach-cap-{capability}"


def ui_details(inp: InvokeInput, response: InvokeResponse | None) -> str:
    """One line for the Temporal UI: `capability.operation from caller → status`."""
    line = f"{inp.target}.{inp.operation} from {inp.caller} → "
    if response is None:
        return line + "running"
    line += response.status
    if response.error is not None:
        line += f" ({response.error.type})"
    if response.instance_id:
        line += f" on {response.instance_id}"
    if response.duration_ms is not None:
        line += f" in {response.duration_ms} ms"
    return line


class _Failed(Exception):
    def __init__(self, error: ErrorInfo, instance_id: str | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.instance_id = instance_id


class _StaleRoute(Exception):
    """The instance chosen at the door left before anything was sent: route attempt 1 again."""


def _error_of(exc: FailureError, instance_id: str | None) -> _Failed:
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
    return _Failed(info, instance_id)


@workflow.defn(name=WORKFLOW_INVOKE, failure_exception_types=[ValidationError])
class InvokeWorkflow:
    def __init__(self) -> None:
        self._late: LateAnswer | None = None
        # Instances this run has called, with the principal that registered each: who may answer.
        self._sent_to: dict[str, str | None] = {}
        self._final: InvokeResponse | None = None
        self._attempts: list[AttemptInfo] = []
        self._waited_ms: int | None = None
        self._deadline_ms = 0
        self._sent = False  # whether any attempt got as far as calling an agent
        self._in_flight = False  # whether the current attempt was sent
        # The first attempt that was sent and whose outcome was never learnt, if any.
        self._unknown: _Failed | None = None
        self._start_ms = 0  # when the request may go: acceptance, or its token (queue)
        self._plan = CallPlan(timeout_ms=1, idempotent=False, max_retries=0)  # set by _invoke
        self._door_used = False  # whether the call to the instance chosen at the door began

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
        # Only an instance the request was sent to answers it (an answer naming none is the
        # gateway's to allow: it requires instance_id when tokens are on).
        sender = answer.instance_id
        if sender is not None and sender not in self._sent_to:
            raise ApplicationError(
                f"this request was not sent to instance {sender!r}", type="forbidden"
            )
        # With tokens, the principal that registered the instance the request went to answers,
        # whatever instance_id an answer names (another token may re-use a name after a leave).
        if answer.principal is not None:
            owners = [self._sent_to[sender]] if sender is not None else list(self._sent_to.values())
            if not any(owner in (None, answer.principal) for owner in owners):
                raise ApplicationError(
                    f"this request was not sent to an instance of {answer.principal!r}",
                    type="forbidden",
                )

    @workflow.query(name=QUERY_ATTEMPTS)
    def attempts_so_far(self) -> list[AttemptInfo]:
        """What a running request has tried so far (GET /reach/requests/{id} while running)."""
        return list(self._attempts)

    @workflow.signal(name=SIGNAL_LATE_ANSWER)
    def late_answer(self, answer: LateAnswer) -> None:
        # Requests accepted before late answers were an update. The first answer wins.
        if self._late is None:
            self._late = answer

    @workflow.run
    async def run(self, inp: InvokeInput) -> InvokeResponse:
        # The Temporal UI's line for the request (workflow state only, never in history).
        workflow.set_current_details(ui_details(inp, None))
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
        workflow.set_current_details(ui_details(inp, response))
        if inp.endpoint is not None and not self._door_used and inp.plan.mode == "inline":
            await self._release_door_route(inp)
        changed = self._outcome_attributes(inp, response)
        if changed:
            workflow.upsert_search_attributes(changed)
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

    async def _release_door_route(self, inp: InvokeInput) -> None:
        """The door counted attempt 1 in flight on its instance until the call begins; this
        request ended without that call (deadline, idempotency key): free the slot now rather
        than when the count lapses (a few seconds), in the process that made it."""
        try:
            await workflow.execute_local_activity(
                ACTIVITY_RELEASE_ROUTE,
                inp.request_id,
                result_type=bool,
                schedule_to_close_timeout=STORE_STEP,
                retry_policy=ONE_ATTEMPT,
            )
        except (ActivityError, ApplicationError, TimeoutError):
            workflow.logger.warning("the door's in-flight count was not freed; it lapses")

    @staticmethod
    def _outcome_attributes(inp: InvokeInput, response: InvokeResponse) -> list[Any]:
        """The search attributes the outcome changes from what the start set (all of them for
        requests accepted before the start set any)."""
        updates: list[Any] = []
        if response.status != inp.status_at_start:
            updates.append(SA_STATUS.value_set(response.status))
        instance = response.instance_id
        if inp.endpoint is None:
            if instance:
                updates.append(SA_INSTANCE.value_set(instance))
        elif instance != inp.endpoint.instance_id:
            updates.append(
                SA_INSTANCE.value_set(instance) if instance else SA_INSTANCE.value_unset()
            )
        return updates

    async def _hand_to_delivery(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        """Start the callback's own workflow; it outlives this one (parent close: abandon)."""
        await workflow.start_child_workflow(
            DeliverCallbackWorkflow.run,
            CallbackInput(url=url, response=response, plan=inp.callback_plan, caller=inp.caller),
            id=delivery_workflow_id(inp.request_id),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            # Each run of a request starts its delivery once, so a closed one already under this
            # id belongs to an earlier request that reused the RequestID after retention.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            execution_timeout=timedelta(seconds=inp.callback_plan.retry_window_s) + DELIVERY_GRACE,
        )

    async def _deliver(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        """Inline delivery: only for requests accepted before `PATCH_DELIVERY_WORKFLOW`."""
        await deliver(
            CallbackInput(url=url, response=response, plan=inp.callback_plan, caller=inp.caller)
        )

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
            attempts=list(self._attempts) or None,
            waited_ms=self._waited_ms,
        )

    def _timeout(self, inp: InvokeInput, instance_id: str | None) -> InvokeResponse:
        message = f"no answer within timeout_ms={self._plan.timeout_ms}"
        unknown = None
        if self._in_flight and not self._plan.idempotent and not inp.idempotency_key:
            # It was sent and never answered: nobody knows whether the agent ran it.
            unknown = True
            message += (
                f"; agent {instance_id} may have run it: repeat it with an idempotency_key "
                "so that it runs at most once"
            )
        return self._envelope(
            inp,
            "timeout",
            error=ErrorInfo(
                type="timeout", message=message, retryable=False, outcome_unknown=unknown
            ),
            instance_id=instance_id,
        )

    async def _invoke(self, inp: InvokeInput) -> InvokeResponse:
        self._plan = inp.plan
        self._deadline_ms = inp.deadline_ms
        self._start_ms = inp.accepted_at_ms
        claim: ClaimInput | None = None
        if inp.idempotency_key and workflow.patched(PATCH_IDEMPOTENCY_CLAIM):
            claim = ClaimInput(
                key=idempotency_scope(inp.caller, inp.target, inp.operation, inp.idempotency_key),
                request_id=inp.request_id,
                fingerprint=payload_fingerprint(inp.payload),
                ttl_s=inp.plan.idempotency_ttl_s,
            )
            try:
                owner = await self._store_step(
                    inp, ACTIVITY_CLAIM_KEY, claim, ClaimOutcome, self._deadline_ms
                )
            except _Failed as failed:
                return self._envelope(inp, "error", error=failed.error)
            if owner.owner != inp.request_id:
                return await self._follow(inp, owner)
        response = await self._attempts_until_done(inp)
        if claim is not None and self._frees_key(response):
            try:
                await self._store_step(
                    inp, ACTIVITY_RELEASE_KEY, claim, bool, self._now_ms() + RELEASE_WINDOW_MS
                )
            except _Failed:
                workflow.logger.warning("could not free the idempotency key; it will expire")
        return response

    def _frees_key(self, response: InvokeResponse) -> bool:
        """Whether a repeat of this key should run again rather than get this result.

        A key keeps what a repeat would get anyway — a success, the agent's definitive refusal
        — and a timeout, whose outcome nobody knows (running it again could run it twice). It
        frees a retryable failure (the agent failed, or could not be reached: trying again is
        the point of the key; the agent sees the same Idempotency-Key) and anything that ended
        before an agent was sent it.
        """
        error = response.error
        if response.status != "error" or error is None or self._unknown is not None:
            return False
        return error.retryable or (error.type in NOTHING_SENT and not self._sent)

    async def _follow(self, inp: InvokeInput, owner: ClaimOutcome) -> InvokeResponse:
        """This key was first used by another request: its result is this one's (no call)."""
        if not owner.same_request:
            return self._envelope(
                inp,
                "error",
                error=ErrorInfo(
                    type="idempotency_conflict",
                    message=f"idempotency_key {inp.idempotency_key!r} was first used by "
                    f"request {owner.owner} with a different payload; use a new key for a "
                    "new request",
                ),
            )
        try:
            first: InvokeResponse = await self._run(
                inp, ACTIVITY_FOLLOW, FollowInput(request_id=owner.owner), InvokeResponse, None
            )
        except _Failed as failed:
            if failed.error.type == "timeout":
                failed.error.message = (
                    f"request {owner.owner}, which holds idempotency_key "
                    f"{inp.idempotency_key!r}, had no result by this request's deadline; "
                    f"GET /reach/requests/{owner.owner} reads it"
                )
            status: RequestStatus = "timeout" if failed.error.type == "timeout" else "error"
            return self._envelope(inp, status, error=failed.error)
        return first.model_copy(
            update={
                "request_id": inp.request_id,
                "duration_ms": max(0, self._now_ms() - inp.accepted_at_ms),
                "replayed_from": owner.owner,
                "delivery": None,
                "attempts": None,  # the first request's own; GET it for them
                "waited_ms": None,
            }
        )

    async def _wait_for_token(self, inp: InvokeInput) -> InvokeResponse | None:
        """`on_limit: queue`: wait on durable timers until every bucket gives a token."""
        queue = inp.plan.queue
        assert queue is not None
        started = self._now_ms()
        misses = 0
        while True:
            try:
                wait_s: float = await self._store_step(
                    inp,
                    ACTIVITY_TAKE_TOKEN,
                    TakeInput(buckets=queue.buckets),
                    float,
                    queue.wait_until_ms,
                )
            except _Failed as failed:
                return self._envelope(inp, "error", error=failed.error)
            if wait_s <= 0:
                break
            if self._now_ms() + wait_s * 1000 >= queue.wait_until_ms:
                self._waited_ms = self._now_ms() - started
                return self._envelope(
                    inp,
                    "error",
                    error=ErrorInfo(
                        type="rate_limited",
                        message=f"rate limit of {inp.target!r} for caller {inp.caller!r}: no "
                        f"token freed within the {self._waited_ms} ms this request could wait",
                        retryable=True,
                        retry_after_s=max(1, int(wait_s + 0.999)),
                    ),
                )
            # Waiters wake spread out, not all at once for the one token that frees, and less
            # often the longer they wait (a long wait stays a short history); never past the
            # time they may wait.
            misses += 1
            spread = wait_s * workflow.random().uniform(1.0, 1.5) * min(8.0, 1.25**misses)
            left_s = (queue.wait_until_ms - self._now_ms()) / 1000
            await workflow.sleep(max(0.01, min(spread, QUEUE_POLL_MAX_S, left_s)))
        self._waited_ms = self._now_ms() - started
        # The call's own time runs from when it may go; a synchronous request's deadline stays.
        self._start_ms = self._now_ms()
        if inp.callback:
            self._deadline_ms = max(self._deadline_ms, self._start_ms + self._plan.timeout_ms)
        return None

    async def _attempts_until_done(self, inp: InvokeInput) -> InvokeResponse:
        if inp.plan.queue is not None:
            refused = await self._wait_for_token(inp)
            if refused is not None:
                return refused
        attempt = 1
        store_waits = redeliveries = 0
        tried: list[str] = []
        # Attempt 1's instance when the door chose it; then the pin of any re-run of attempt 1.
        first = inp.endpoint
        pin: str | None = None
        while True:
            instance_id: str | None = None
            if self._late is not None:  # answered before (or between) attempts: nothing to call
                return self._answered_late(inp, tried[-1] if tried else None)
            started = self._now_ms()
            breaker: str | None = None
            self._in_flight = False
            try:
                from_door = first is not None
                if first is not None:
                    endpoint, first = first, None
                    pin = pin_of(endpoint.instance_id, endpoint.joined_at)
                else:
                    endpoint = await self._run(
                        inp,
                        ACTIVITY_RESOLVE,
                        ResolveInput(
                            capability=inp.target,
                            exclude=tried,
                            routing_key=inp.hash_key or inp.routing_key,
                            request_id=inp.request_id,
                            payload_bytes=inp.payload_bytes,
                            operation=inp.operation,
                            attempt=attempt,
                            deadline_ms=self._deadline_ms,
                            movable=self._movable(inp),
                            pin=pin if attempt == 1 else None,
                        ),
                        Endpoint,
                        None,
                    )
                instance_id = endpoint.instance_id
                self._sent_to[instance_id] = endpoint.principal
                breaker = endpoint.breaker
                self._plan, self._deadline_ms = refine_plan(
                    self._plan,
                    declared_idempotent=endpoint.declared_idempotent,
                    declared_timeout_ms=endpoint.declared_timeout_ms,
                    accepted_at_ms=self._start_ms,
                    deadline_ms=self._deadline_ms,
                )
                message = Message(
                    header=Header(
                        request_id=inp.request_id,
                        caller=inp.caller,
                        target=inp.target,
                        operation=inp.operation,
                        attempt=attempt,
                        deadline_ms=self._deadline_ms,
                        idempotency_key=inp.idempotency_key,
                        traceparent=inp.traceparent,
                    ),
                    payload=inp.payload,
                    metadata=Metadata(size_bytes=inp.payload_bytes),
                )
                remaining = self._deadline_ms - self._now_ms()
                movable = self._movable(inp)
                reply = await self._run(
                    inp,
                    ACTIVITY_CALL,
                    CallInput(
                        endpoint=endpoint,
                        message=message,
                        timeout_ms=max(1, remaining),
                        judge_timeouts=self._plan.judge_timeouts,
                        check_first=from_door,
                        first_run=from_door
                        and workflow.info().get_current_history_length() <= FIRST_TASK_EVENTS,
                        movable=movable
                        if movable is not None
                        else bool(endpoint.declared_idempotent),
                    ),
                    Reply,
                    instance_id,
                )
                outcome = "success" if reply.status == "ok" else "accepted"
                self._note(attempt, instance_id, outcome, started, breaker)
                if self._late is not None:
                    # Acknowledged while the call was still out: that answer came first.
                    return self._answered_late(inp, instance_id)
                if reply.status == "ok":
                    return self._envelope(
                        inp, "success", result=reply.result, instance_id=instance_id
                    )
                return await self._await_late_answer(inp, instance_id)
            except _StaleRoute as stale:
                workflow.logger.info("attempt 1 is routed again: %s", stale)
                pin = None
                continue
            except _Failed as failed:
                self._note(attempt, failed.instance_id, failed.error.type, started, breaker)
                if self._late is not None:
                    return self._answered_late(inp, failed.instance_id)
                if failed.error.type == "timeout":
                    return self._timeout(inp, failed.instance_id)
                if failed.error.outcome_unknown and failed.instance_id is not None:
                    self._unknown = self._unknown or failed
                    delay_s = REDELIVER_FIRST_S * 2**redeliveries
                    if (
                        redeliveries < MAX_REDELIVERIES
                        and self._now_ms() + delay_s * 1000 < self._deadline_ms
                        and workflow.patched(PATCH_REDELIVER)
                    ):
                        # Sent, then the line or the worker broke: the same attempt again goes
                        # to the same (pinned) instance, which answers a RequestID it already
                        # has from memory, never to another one that would run it a second time.
                        redeliveries += 1
                        self._attempts[-1].backoff_ms = int(delay_s * 1000)
                        await workflow.sleep(delay_s)
                        continue
                if (
                    failed.instance_id is None
                    and failed.error.type == "unavailable"
                    and workflow.patched(PATCH_STORE_OUTAGE_WAIT)
                ):
                    # The store was away while routing: nothing was sent, so whatever the
                    # operation, the request waits it out (until its deadline) on the same
                    # attempt.
                    delay_s = min(STORE_RETRY_MAX_S, STORE_RETRY_FIRST_S * 2**store_waits)
                    if self._now_ms() + delay_s * 1000 < self._deadline_ms:
                        store_waits += 1
                        self._attempts[-1].backoff_ms = int(delay_s * 1000)
                        await workflow.sleep(delay_s)
                        continue
                step = next_step(
                    self._plan,
                    attempt=attempt,
                    retryable=failed.error.retryable and failed.error.type != "circuit_open",
                    failed_instance=failed.instance_id,
                    now_ms=self._now_ms(),
                    deadline_ms=self._deadline_ms,
                    rand=workflow.random().random() if self._plan.jitter else 0.0,
                )
                if isinstance(step, GiveUp):
                    workflow.logger.info("giving up after attempt %d: %s", attempt, step.reason)
                    last = self._last_failure(inp, failed)
                    return self._envelope(
                        inp, "error", error=last.error, instance_id=last.instance_id
                    )
                workflow.logger.info(
                    "attempt %d failed (%s); retrying in %.1fs",
                    attempt,
                    failed.error.type,
                    step.delay_s,
                )
                self._attempts[-1].backoff_ms = int(step.delay_s * 1000)
                if step.avoid_instance:
                    tried.append(step.avoid_instance)
                await workflow.sleep(step.delay_s)
                attempt += 1

    def _movable(self, inp: InvokeInput) -> bool | None:
        """Whether a re-run of an attempt may go elsewhere when its instance is gone."""
        if self._plan.idempotent or inp.idempotency_key:
            return True
        return False if self._plan.idempotent_configured else None

    def _last_failure(self, inp: InvokeInput, failed: _Failed) -> _Failed:
        """What a request that gives up reports. If an attempt was sent and never answered, a
        request that is neither idempotent nor keyed reports that attempt — it may have run —
        and is no longer 'retryable', whatever the re-deliveries after it met."""
        unknown = self._unknown
        if unknown is None or self._plan.idempotent or inp.idempotency_key:
            return failed
        error = unknown.error.model_copy(
            update={
                "retryable": False,
                "outcome_unknown": True,
                "message": f"{unknown.error.message}; it was sent and its answer never came, "
                "so it may have run: repeat it with an idempotency_key to be safe",
            }
        )
        return _Failed(error, unknown.instance_id)

    def _note(
        self,
        attempt: int,
        instance_id: str | None,
        outcome: str,
        started_ms: int,
        breaker: str | None,
    ) -> None:
        self._attempts.append(
            AttemptInfo(
                attempt=attempt,
                instance_id=instance_id,
                outcome=outcome,
                duration_ms=max(0, self._now_ms() - started_ms),
                breaker=breaker,
            )
        )

    async def _store_step(
        self, inp: InvokeInput, name: str, arg: Any, result_type: type[Any], until_ms: int
    ) -> Any:
        """A quick store step (claim, token, release): a local activity, tried again on durable
        timers while the store is away, until `until_ms` — an accepted request outlives a
        Redis restart."""
        delay_s = STORE_RETRY_FIRST_S
        while True:
            try:
                return await workflow.execute_local_activity(
                    name,
                    arg,
                    result_type=result_type,
                    schedule_to_close_timeout=STORE_STEP,
                    retry_policy=ONE_ATTEMPT,
                )
            except (ActivityError, ApplicationError, TimeoutError) as exc:
                failed = _error_of(exc, None)
                if failed.error.type == "timeout":
                    failed.error = ErrorInfo(
                        type="unavailable",
                        message=f"the policy store did not answer ({name})",
                        retryable=True,
                    )
                if not failed.error.retryable or self._now_ms() + delay_s * 1000 >= until_ms:
                    raise failed from exc
                workflow.logger.warning(
                    "%s failed (%s); trying again in %.1fs", name, failed.error.message, delay_s
                )
            await workflow.sleep(delay_s)
            delay_s = min(STORE_RETRY_MAX_S, delay_s * 2)

    async def _run(
        self,
        inp: InvokeInput,
        name: str,
        arg: Any,
        result_type: type[Any],
        instance_id: str | None,
    ) -> Any:
        remaining = self._deadline_ms - self._now_ms()
        if remaining <= 0:
            raise _Failed(
                ErrorInfo(type="timeout", message="deadline reached", retryable=False), instance_id
            )
        budget = timedelta(milliseconds=remaining)
        sent_before = self._sent
        if name == ACTIVITY_CALL:
            self._sent = self._in_flight = True
            # The call takes the door's in-flight count over as it begins, whatever follows.
            self._door_used = self._door_used or (isinstance(arg, CallInput) and arg.check_first)
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
            cause = exc.cause if isinstance(exc, ActivityError) else exc
            if isinstance(cause, ApplicationError) and cause.type == STALE_ROUTE:
                self._sent, self._in_flight = sent_before, False  # nothing was sent
                raise _StaleRoute(cause.message) from exc
            raise _error_of(exc, instance_id) from exc

    async def _await_late_answer(self, inp: InvokeInput, instance_id: str) -> InvokeResponse:
        remaining = self._deadline_ms - self._now_ms()
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
