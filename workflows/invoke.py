"""InvokeWorkflow: one durable request, keyed by its RequestID (workflow id = request_id).

Resolve an instance, call it through its connector, wait for a late answer if the agent accepted
the request (202), and hand the result to a callback delivery if the caller gave one. The
deadline (`deadline_ms`, fixed at acceptance) bounds every step. After a failure the workflow
asks `reach.policy.retry` what to do — try again (after a durable timer, on the same or another
instance), wait for the store, or report — and does it (`workflows._attempts`, its base class).

The result is final as soon as it is known: the workflow completes with it (an error or a
timeout fails it, the envelope its failure's one detail: `reach.outcome`), and a callback is
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

import asyncio
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import SearchAttributeKey, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from reach.invocation import (
        ACTIVITY_CLAIM_KEY,
        ACTIVITY_FOLLOW,
        ACTIVITY_RELEASE_KEY,
        ACTIVITY_RELEASE_ROUTE,
        ACTIVITY_TAKE_TOKEN,
        SIGNAL_LATE_ANSWER,
        UPDATE_LATE_ANSWER,
        WORKFLOW_INVOKE,
        CallbackInput,
        ClaimInput,
        ClaimOutcome,
        FollowInput,
        InvokeInput,
        LateAnswer,
        TakeInput,
        answer_key,
        delivery_workflow_id,
        idempotency_scope,
        payload_fingerprint,
    )
    from reach.messages import AttemptInfo, ErrorInfo, InvokeResponse, RequestStatus
    from reach.outcome import FAILED_OUTCOME, PATCH_FAILED_OUTCOME, fails, failure_message
    from reach.policy import Failure, GiveUp, after_no_token
    from workflows._attempts import AttemptLoop, follows
    from workflows._attempts import capability_queue as capability_queue  # worker.py's
    from workflows._failures import (
        ONE_ATTEMPT,
        STORE_STEP,
        Failed,
        cancel_requested,
        sent_by_lost_run,
    )
    from workflows.callback import DeliverCallbackWorkflow, deliver

SA_CALLER = SearchAttributeKey.for_keyword("ReachCaller")
SA_CAPABILITY = SearchAttributeKey.for_keyword("ReachCapability")
SA_OPERATION = SearchAttributeKey.for_keyword("ReachOperation")
SA_STATUS = SearchAttributeKey.for_keyword("ReachStatus")
SA_INSTANCE = SearchAttributeKey.for_keyword("ReachInstance")
SEARCH_ATTRIBUTES = (SA_CALLER, SA_CAPABILITY, SA_OPERATION, SA_STATUS, SA_INSTANCE)

# Requests accepted before callbacks had a workflow of their own deliver inline (replay only).
PATCH_DELIVERY_WORKFLOW = "callback-delivery-workflow"
QUERY_ATTEMPTS = "attempts"
# Requests accepted before idempotency keys were claimed in the store skip the claim (replay).
PATCH_IDEMPOTENCY_CLAIM = "idempotency-key-claim"
# Requests accepted before a cancel read the current attempt's pin ended canceled as if nothing
# ran when a lost task (its timer fired there) had sent it.
PATCH_CANCEL_READS_PIN = "cancel-reads-lost-pin"
# Errors that end a request before any agent was sent it: its idempotency key is freed.
NOTHING_SENT = frozenset(
    {"no_instance", "circuit_open", "rate_limited", "payload_too_large", "unknown_capability"}
)
# How long freeing an idempotency key keeps trying (it expires on its own anyway).
RELEASE_WINDOW_MS = 60_000
# How long a callback delivery may outlive its retry window (the final attempt's own timeout).
DELIVERY_GRACE = timedelta(minutes=5)


def _callback_input(inp: InvokeInput, url: str, response: InvokeResponse) -> CallbackInput:
    return CallbackInput(
        url=url,
        response=response,
        plan=inp.callback_plan,
        caller=inp.caller,
        target=inp.target,
        operation=inp.operation,
    )


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


@workflow.defn(name=WORKFLOW_INVOKE, failure_exception_types=[ValidationError])
class InvokeWorkflow(AttemptLoop):
    def __init__(self) -> None:
        super().__init__()
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
        # Only an instance the request was sent to answers it (an answer naming none is the
        # gateway's to allow: it requires instance_id when tokens are on).
        sender = answer.instance_id
        if sender is not None and sender not in self._sent_to:
            if not self._sent or self._routing:
                # Not known yet: a worker taking over a lost task (its process died) is handed
                # the answers that came meanwhile before it runs the attempt that task sent
                # again, so who was sent the request shows only once that attempt is routed.
                raise ApplicationError(
                    "this request is being routed; send the answer again", type="not_yet"
                )
            raise ApplicationError(
                f"this request was not sent to instance {sender!r}", type="forbidden"
            )
        # With tokens, the principal that registered the instance the request went to answers,
        # whatever instance_id an answer names (another token may re-use a name after a leave).
        # An instance nobody owned when it was sent (an operator registered it, or it joined
        # before tokens) is answered for with an admin token only (`principal` None): any agent
        # token could take its name over once its record is gone.
        if answer.principal is not None:
            owners = [self._sent_to[sender]] if sender is not None else list(self._sent_to.values())
            if answer.principal not in owners:
                unowned = " (held by nobody when it was sent: an admin token answers for it)"
                raise ApplicationError(
                    f"this request was not sent to an instance of {answer.principal!r}"
                    + (unowned if None in owners else ""),
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
        except asyncio.CancelledError:
            # Its caller cancelled it (a workflow cancel: A2A CancelTask, MCP tasks/cancel, an
            # operator): it ends `canceled`, its callback told so. Those accepted before this
            # rule end cancelled, without a result, as they did (workflows._failures).
            if not cancel_requested():
                raise
            response = self._cancelled(inp, await self._sent_by_lost_task(inp))
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
        if fails(response) and workflow.patched(PATCH_FAILED_OUTCOME):
            # Failed in the Temporal UI too, the envelope its one detail (reach.outcome).
            raise ApplicationError(
                failure_message(response), response, type=FAILED_OUTCOME, non_retryable=True
            )
        return response

    async def _sent_by_lost_task(self, inp: InvokeInput) -> str | None:
        """Cancelled with no call in flight nor an attempt known unknown: the instance a lost
        task sent the current attempt to, if its pin says so (a task that fired a wait's timer,
        routed and sent the attempt and was lost leaves nothing else; the cancel then came
        before this run got that far)."""
        if self._in_flight or self._tries.unknown is not None:
            return None
        if not workflow.patched(PATCH_CANCEL_READS_PIN):
            return None
        attempt = self._tries.number
        return await sent_by_lost_run(inp, attempt, self._pins.made(attempt))

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
            _callback_input(inp, url, response),
            id=delivery_workflow_id(inp.request_id),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            # Each run of a request starts its delivery once, so a closed one already under this
            # id belongs to an earlier request that reused the RequestID after retention.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            execution_timeout=timedelta(seconds=inp.callback_plan.retry_window_s) + DELIVERY_GRACE,
        )

    async def _deliver(self, inp: InvokeInput, url: str, response: InvokeResponse) -> None:
        """Inline delivery: only for requests accepted before `PATCH_DELIVERY_WORKFLOW`."""
        await deliver(_callback_input(inp, url, response))

    async def _invoke(self, inp: InvokeInput) -> InvokeResponse:
        self._plan = inp.plan
        self._history_at_start = workflow.info().get_current_history_length()
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
            except Failed as failed:
                return await self._claim_failed(inp, failed)
            if owner.owner != inp.request_id:
                return await self._follow(inp, owner)
        response = await self._wait_for_token(inp) if inp.plan.queue is not None else None
        if response is None:
            response = await self._attempts_until_done(inp)
        if claim is not None and self._frees_key(response):
            try:
                await self._store_step(
                    inp, ACTIVITY_RELEASE_KEY, claim, bool, self._now_ms() + RELEASE_WINDOW_MS
                )
            except Failed:
                workflow.logger.warning("could not free the idempotency key; it will expire")
        return response

    async def _claim_failed(self, inp: InvokeInput, failed: Failed) -> InvokeResponse:
        """The idempotency key could not be claimed (the store stayed away until the deadline,
        or refused it). After a lost earlier task, that task may have claimed it and sent the
        request: then nobody knows whether it ran (`workflows._lost_start`)."""
        said = await self._lost_first(inp)
        if said is None or not said[0]:
            return self._envelope(inp, "error", error=failed.error)
        error = failed.error.model_copy(update={"retryable": False, "outcome_unknown": True})
        if failed.error.retryable:  # the store was waited for until the deadline
            error = ErrorInfo(type="timeout", message="deadline reached", outcome_unknown=True)
            return self._timeout(inp, Failure(error, said[1], sent=True))
        return self._envelope(inp, "error", error=error, instance_id=said[1])

    def _frees_key(self, response: InvokeResponse) -> bool:
        """Whether a repeat of this key should run again rather than get this result.

        A key keeps what a repeat would get anyway — a success, the agent's definitive refusal
        — and a timeout, whose outcome nobody knows (running it again could run it twice). It
        frees a retryable failure (the agent failed, or could not be reached: trying again is
        the point of the key; the agent sees the same Idempotency-Key) and anything that ended
        before an agent was sent it.
        """
        error = response.error
        if response.status != "error" or error is None or self._tries.unknown is not None:
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
        except Failed as failed:
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
            except Failed as failed:
                return self._envelope(inp, "error", error=failed.error)
            if wait_s <= 0:
                break
            misses += 1
            step = after_no_token(
                wait_s,
                miss=misses,
                now_ms=self._now_ms(),
                until_ms=queue.wait_until_ms,
                draw=workflow.random().random,
                follows=follows,
            )
            if isinstance(step, GiveUp):
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
            await self._sleep(step.delay_s)
        self._waited_ms = self._now_ms() - started
        # The call's own time runs from when it may go; a synchronous request's deadline stays.
        self._start_ms = self._now_ms()
        if inp.callback:
            self._deadline_ms = max(self._deadline_ms, self._start_ms + self._plan.timeout_ms)
        return None
