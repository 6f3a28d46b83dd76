"""The attempts of one request: route, call, wait for a late answer — and after each failure,
carry out what `reach.policy.retry` decides (a timer, a route again, a report).

`AttemptLoop` is `InvokeWorkflow`'s base: the request's life (idempotency, callbacks, its
handlers) is in `workflows.invoke`; how it reaches an answer is here. Nothing here decides
whether, when or where to try again: each failure becomes a `Failure`, and the step the policy
returns is executed as it is. The policy asks whether a request follows a rule newer than it
through `workflow.patched`, at the points these patches were always asked, so every history
recorded before replays as it ran.
"""

from __future__ import annotations

import builtins
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from reach.errors import AgentFault
    from reach.invocation import (
        ACTIVITY_CALL,
        ACTIVITY_RESOLVE,
        STALE_ROUTE,
        CallInput,
        CallPlan,
        Endpoint,
        InvokeInput,
        LateAnswer,
        ResolveInput,
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
    from reach.outcome import may_have_run
    from reach.policy import (
        Attempts,
        Failure,
        GiveUp,
        Redeliver,
        Retry,
        RouteAgain,
        WaitForStore,
        after_failure,
        refine_plan,
        timed_out,
    )
    from workflows._failures import (
        FIRST_TASK_EVENTS,
        ONE_ATTEMPT,
        Failed,
        StaleRoute,
        cancelled,
        error_of,
        forget_unsent,
        name_lost_attempt,
        names_lost_later,
        sent_by_lost_run,
    )
    from workflows._following import TaskFollowing
    from workflows._following import capability_queue as capability_queue  # invoke.py's
    from workflows._lost_start import sent_by_lost_first_task, started_after_lost_task
    from workflows._pins import RunPins, current_history
    from workflows._rules import follows as follows  # invoke.py's
    from workflows._store_steps import store_step

UNSENT = ("deadline reached before the call was sent", "deadline reached")  # [lost run]
NEVER = "; it was never sent: no agent ran it"  # (a timeout's: `AttemptLoop._timeout`)
# How the log names each step that waits (operators and tests read "retrying in").
DOING = {Retry: "retrying", Redeliver: "re-delivering", WaitForStore: "waiting for the store"}


class AttemptLoop(TaskFollowing):
    def __init__(self) -> None:
        self._late: LateAnswer | None = None
        # Instances this run has called, with the principal that registered each: who may answer.
        self._sent_to: dict[str, str | None] = {}
        self._routing = False  # an attempt's resolve is out: whom it goes to is not known yet
        self._attempts: list[AttemptInfo] = []
        self._tries = Attempts()
        self._waited_ms: int | None = None
        self._deadline_ms = 0
        self._sent = False  # whether any attempt got as far as calling an agent
        self._in_flight = False  # whether the current attempt was sent
        self._start_ms = 0  # when the request may go: acceptance, or its token (queue)
        self._plan = CallPlan(timeout_ms=1, idempotent=False, max_retries=0)  # set by _invoke
        self._door_used = False  # whether the call to the instance chosen at the door began
        self._slept = False  # whether this request has waited on a durable timer
        self._history_at_attempt = 0  # the history's length when the current attempt began
        self._pinned_before = False  # resolve found this attempt pinned by another (lost) run
        self._pins = RunPins()  # this run's pin claims of each attempt
        self._calling: str | None = None  # the instance the current attempt's call went to
        self._cancel_said: str | None = None  # set when a cancel asked an agent's task to stop
        self._history_at_start = 0  # the history's length when this run began (`_lost_start`)

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

    def _timeout(self, inp: InvokeInput, report: Failure) -> InvokeResponse:
        """The deadline's envelope; `report` is what `timed_out` made of it."""
        message = f"no answer within timeout_ms={self._plan.timeout_ms}"
        unknown = report.error.outcome_unknown or None  # unsent: no instance, and it says so
        instance_id, message = (report.instance_id, message) if unknown else (None, message + NEVER)
        if unknown:  # it was (or may have been) sent, never answered: did it run? nobody knows
            who = f"agent {instance_id}" if instance_id else "the agent it was sent to"
            keyed = bool(inp.idempotency_key)
            message += "; " + may_have_run(who, idempotent=self._plan.idempotent, keyed=keyed)
        return self._envelope(
            inp,
            "timeout",
            error=ErrorInfo(
                type="timeout", message=message, retryable=False, outcome_unknown=unknown
            ),
            instance_id=instance_id,
        )

    def _lost_before(self) -> bool:
        """Whether an earlier workflow task ran this attempt and was lost (its worker was
        killed, or Temporal away timed it out): its call, a local activity, may have been
        sent and never reported. Told by resolve (`Endpoint.pinned_before`), and for attempt
        1 in the request's first task: the history then holds more than a first task's."""
        return self._pinned_before or (
            self._tries.number == 1
            and self._tries.redeliveries == 0
            and not self._slept
            and self._history_at_attempt > FIRST_TASK_EVENTS
        )

    async def _lost_first(self, inp: InvokeInput) -> tuple[bool, str | None] | None:
        """What a lost earlier task may have sent, when this run began after it and has sent
        nothing itself (`workflows._lost_start`); None: not asked."""
        if self._sent or self._tries.redeliveries or self._tries.unknown is not None:
            return None
        if not started_after_lost_task(self._history_at_start):
            return None
        return await sent_by_lost_first_task(inp, self._pins.made(1))

    async def _sleep(self, delay_s: float) -> None:
        self._slept = True
        await workflow.sleep(delay_s)

    def _cancelled(self, inp: InvokeInput, lost_to: str | None = None) -> InvokeResponse:
        """The envelope of a request its caller cancelled (`workflows._failures.cancelled`);
        `lost_to`: the instance a lost task sent the current attempt to (its pin)."""
        earlier = self._tries.unknown  # an earlier attempt whose outcome nobody knows
        instance_id = self._calling if self._in_flight else getattr(earlier, "instance_id", None)
        instance_id, unknown = instance_id or lost_to, earlier is not None or lost_to is not None
        error = cancelled(self._in_flight, unknown, instance_id, self._cancel_said)
        return self._envelope(inp, "canceled", error=error, instance_id=instance_id)

    async def _attempts_until_done(self, inp: InvokeInput) -> InvokeResponse:
        # Attempt 1's instance when the door chose it; then the pin of any re-run of attempt 1.
        first = inp.endpoint
        pin: str | None = None
        while True:
            tries = self._tries
            if self._late is not None:  # answered before (or between) attempts: nothing to call
                return self._answered_late(inp, tries.avoid[-1] if tries.avoid else None)
            door, first = first, None
            if door is not None:
                pin = pin_of(door.instance_id, door.joined_at)
            try:
                return await self._attempt(inp, door, pin if tries.number == 1 else None)
            except StaleRoute as stale:
                workflow.logger.info("attempt 1 is routed again: %s", stale)
                error = ErrorInfo(type="no_instance", message=str(stale), retryable=True)
                # A lost task's may have sent it (remembered for the attempt: `RunPins.saw`).
                lost = self._pins.saw(tries.number, stale.pinned_before) or self._lost_before()
                failure = Failure(error, stale_route=True, lost_run=lost)
            except Failed as failed:
                if self._late is not None:
                    return self._answered_late(inp, failed.instance_id)
                lost = self._pins.saw(tries.number, failed.pinned_before) or self._lost_before()
                named, made = None, self._pins.made(tries.number)  # a lost task's instance
                if failed.unrouted and not lost:
                    said = await self._lost_first(inp) if tries.number == 1 else None
                    if said is None:
                        named = await sent_by_lost_run(inp, tries.number, made)
                    else:
                        lost, named = said
                failure = Failure(
                    failed.error,
                    failed.instance_id or named,
                    sent=self._in_flight or lost or named is not None,
                    not_sent=failed.not_sent,
                    lost_run=(lost and not failed.claimed) or named is not None,
                )
                self._in_flight = False  # that call is over (a cancel from here finds none)
            step, self._tries = after_failure(
                self._plan,
                tries,
                failure,
                keyed=bool(inp.idempotency_key),
                now_ms=self._now_ms(),
                deadline_ms=self._deadline_ms,
                follows=follows,
                draw=workflow.random().random,
            )
            if isinstance(step, GiveUp):
                workflow.logger.info("giving up after attempt %d: %s", tries.number, step.reason)
                assert step.report is not None
                report = step.report
                unnamed = report.error.outcome_unknown and report.instance_id is None
                if unnamed and names_lost_later(failure.sent, self._tries):
                    report = await name_lost_attempt(inp, report)
                return self._reported(inp, report)
            if isinstance(step, RouteAgain):
                pin = None
                continue
            workflow.logger.info(
                "attempt %d failed (%s); %s in %.1fs",
                tries.number,
                failure.error.type,
                DOING[type(step)],
                step.delay_s,
            )
            if self._attempts:  # a route that went stale left no attempt to note
                self._attempts[-1].backoff_ms = int(step.delay_s * 1000)
            await self._sleep(step.delay_s)

    def _reported(self, inp: InvokeInput, report: Failure) -> InvokeResponse:
        if report.error.type == "timeout":
            return self._timeout(inp, report)
        return self._envelope(inp, "error", error=report.error, instance_id=report.instance_id)

    async def _attempt(
        self, inp: InvokeInput, door: Endpoint | None, pin: str | None
    ) -> InvokeResponse:
        """Attempt `self._tries.number`, on `door` (the door's choice) or where resolve routes
        it: the request's result, or `Failed` (recorded) / `StaleRoute` (nothing sent)."""
        attempt = self._tries.number
        started = self._now_ms()
        breaker: str | None = None
        self._in_flight = False
        self._history_at_attempt = workflow.info().get_current_history_length()
        self._pinned_before = False
        first_run = current_history() <= FIRST_TASK_EVENTS  # with a door's route
        resolved_at, token, again = current_history(), None, 0
        if door is None or not first_run:  # a pin is claimed: resolve's, or the door route's
            token, again = self._pins.claim(attempt, door=door is not None)
        resolving = door is None  # until resolve answers: a failure then leaves its claim unsure
        try:
            if door is not None:
                endpoint = door
            else:
                endpoint = await self._run(
                    inp,
                    ACTIVITY_RESOLVE,
                    ResolveInput(
                        capability=inp.target,
                        exclude=list(self._tries.avoid),
                        routing_key=inp.hash_key or inp.routing_key,
                        request_id=inp.request_id,
                        payload_bytes=inp.payload_bytes,
                        operation=inp.operation,
                        attempt=attempt,
                        deadline_ms=self._deadline_ms,
                        movable=self._movable(inp),
                        pin=pin,
                        token=token,
                        again=again,
                    ),
                    Endpoint,
                    None,
                )
                resolving = False
            instance_id = endpoint.instance_id
            self._pinned_before = self._pins.saw(attempt, endpoint.pinned_before)
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
                    context_id=inp.context_id,
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
                    check_first=door is not None,
                    first_run=door is not None and first_run,
                    movable=movable if movable is not None else bool(endpoint.declared_idempotent),
                    pin_token=token if door is not None else None,
                    routed_here=door is None and self._routed_here(attempt, resolved_at),
                ),
                Reply,
                instance_id,
            )
        except Failed as failed:
            if token is not None:
                inline = resolving and inp.plan.mode != "queue"
                self._pins.failed(attempt, unrouted=failed.unrouted, inline_resolve=inline)
            at = None if failed.error.message == UNSENT[False] else failed.instance_id
            self._note(attempt, at, failed.error.type, started, breaker)
            raise
        # "accepted", or an agent's task that ended asking (input_required) or canceled.
        outcome = "success" if reply.status == "ok" else reply.status
        self._note(attempt, instance_id, outcome, started, breaker)
        if self._late is not None:
            # Acknowledged while the call was still out: that answer came first.
            return self._answered_late(inp, instance_id)
        if reply.follow is not None:  # the agent's own long work, followed (workflows._following)
            return await self._follow_task(inp, endpoint, reply.follow)
        if reply.status != "accepted":
            return self._final_reply(inp, reply, instance_id)
        return await self._await_late_answer(inp, instance_id)

    def _routed_here(self, attempt: int, resolved_at: int) -> bool:
        """Whether the call of the attempt just resolved can follow no send of it (`RunPins`)."""
        tries = self._tries
        settled = tries.unknown is None and not tries.redeliveries and not self._lost_before()
        return self._pins.routed_here(attempt, resolved_at, settled=settled)

    def _movable(self, inp: InvokeInput) -> bool | None:
        """Whether a re-run of an attempt may go elsewhere when its instance is gone."""
        if self._plan.idempotent or inp.idempotency_key:
            return True
        return False if self._plan.idempotent_configured else None

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
        """A quick store step (claim, token, release), waiting for the store until `until_ms`."""
        del inp
        return await store_step(
            name, arg, result_type, until_ms, now_ms=self._now_ms, sleep=self._sleep
        )

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
            lost = self._lost_before() or self._tries.unknown  # it may have been sent
            error = ErrorInfo(type="timeout", message=UNSENT[bool(lost)], retryable=False)
            # Not routed by this run: resolve's turn, or the door's route about to be called.
            door = isinstance(arg, CallInput) and arg.check_first
            raise Failed(error, instance_id, unrouted=name == ACTIVITY_RESOLVE or door)
        budget = timedelta(milliseconds=remaining)
        sent_before, self._routing = self._sent, name == ACTIVITY_RESOLVE
        if name == ACTIVITY_CALL:
            self._sent = self._in_flight = True
            self._calling = arg.endpoint.instance_id if isinstance(arg, CallInput) else None
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
                    # Both heartbeat (`activities._heartbeats`): a lost worker is noticed.
                    heartbeat_timeout=timedelta(seconds=10)
                    if name in (ACTIVITY_CALL, ACTIVITY_RESOLVE)
                    else None,
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
                forget_unsent(self._sent_to, arg, queue=inp.plan.mode == "queue")
                raise StaleRoute.of(cause) from exc
            raise error_of(exc, instance_id, routing=name == ACTIVITY_RESOLVE) from exc

    async def _await_late_answer(self, inp: InvokeInput, instance_id: str) -> InvokeResponse:
        remaining = self._deadline_ms - self._now_ms()
        try:
            await workflow.wait_condition(
                lambda: self._late is not None, timeout=timedelta(milliseconds=max(1, remaining))
            )
        except builtins.TimeoutError:
            # Accepted (202) by the agent and never answered: sent, so it may have run.
            error = ErrorInfo(type="timeout", message="deadline reached", retryable=False)
            report = timed_out(
                self._plan,
                self._tries,
                Failure(error, instance_id, sent=True),
                keyed=bool(inp.idempotency_key),
            )
            return self._timeout(inp, report)
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
