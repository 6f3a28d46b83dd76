"""Following an agent's own long work (an A2A task) that a call answered with a handle for.

The call's `Reply.follow` is in the request's history (the activity's result), so from there on
nothing sends the message again: a worker or gateway that restarts replays to the same handle
and goes on following it. Following is a loop of looks (`reach.follow_task`), each a regular
activity that asks about the task (A2A: `GetTask`) for up to `LOOK_WINDOW_MS`, polling in its
process from 10 ms apart growing to a second, and returns as soon as the task has ended:

- the first look is scheduled at once: scheduling a regular activity completes the workflow
  task, which records the handle before anything else happens (a durable timer would do the
  same, but Temporal fires timers shorter than a second only after about one);
- a task still going after a look's window waits on a durable timer, from `FIRST_WAIT_S`
  growing by `GROWTH` to `MAX_WAIT_S`, never past the deadline, before the next look (a day-long
  task costs about a thousand looks in its history);
- a late answer (`POST /reach/requests/{id}/result`) ends a wait at once;
- a look that gets no answer (the agent unreachable or slow, the worker lost) is tried again;
  after `UNREACHABLE_S` without one the request ends `transport_error`, its outcome unknown;
- a final look ends the request: success, `input_required`, `canceled`, or the agent's error;
- when the deadline passes first, the agent is asked to stop (`reach.cancel_task`) and the
  request ends `timeout`, its outcome unknown (the agent may have done some or all of it);
- when the request is cancelled (a workflow cancel), the agent is asked to stop likewise, in a
  shielded step the cancel cannot reach, before the request ends `canceled`
  (`workflows._failures`; requests accepted before that rule end as they did).

Push notifications (the agent's card says it sends them, and the connector sent the message
with a push config pointing at the gateway: the handle says `push`, `PATCH_A2A_PUSH`): every
look after the first asks once (no window of polling in process), and the wait between looks
ends at once when a notification arrives (the gateway's `POST /reach/a2a/push/{request_id}`
signals `SIGNAL_A2A_PUSH`, nothing more: the look that follows reads the task from the agent,
so what a notification says is never taken on its word). Polling stays the fallback on a
longer timer, from `PUSH_FIRST_WAIT_S` growing to `PUSH_MAX_WAIT_S`: a notification that never
comes, or came while no gateway was up, delays the end by one such wait at most.

A flood of notifications (each gateway signals a request at most once a second, but several
gateways, or a replayed token, can still send many) must neither delay the end nor grow the
history without bound (`PATCH_A2A_PUSH_PACE`): a look a notification woke leaves the fallback
poll's backoff and schedule as they were (the poll looks when it was due, however many
notifications came between), and two looks are at least `MIN_LOOK_GAP_S` apart. Requests
accepted before that rule grew the poll's wait with every look, so pushes that stopped left
the end unseen for minutes.

Streaming (the card says the agent streams and no push config was sent: the handle says
`stream`, `PATCH_A2A_STREAM`): the first look is one long activity that re-attaches to the
task's stream (A2A `SubscribeToTask`), heartbeats while it waits, and returns when the task
reaches a final or interrupted state, so the end is seen as the agent says it. When the stream
ends or breaks first, the activity asks once (`GetTask`) and the workflow falls back to
polling on timers, as above; a look lost with its worker (its heartbeat stops) subscribes
again. The handle was in history before the subscription began, so a worker or gateway killed
mid-stream never sends the message again.

Nothing here is retried by the policy: the request was delivered once, and its work is the
agent's. Requests recorded before follow handles existed never reach this code (their replies
carry none), so no history needs a patch for it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from reach.invocation import (
        ACTIVITY_CANCEL_TASK,
        ACTIVITY_FOLLOW_TASK,
        CallPlan,
        Endpoint,
        FollowTaskInput,
        InvokeInput,
        LateAnswer,
    )
    from reach.messages import ErrorInfo, InvokeResponse, Reply, RequestStatus
    from reach.security.a2a_push import SIGNAL_A2A_PUSH
    from workflows._failures import cancel_requested, error_of

FIRST_WAIT_S = 1.0
GROWTH = 1.5
MAX_WAIT_S = 60.0
LOOK_WINDOW_MS = 10_000
LOOK_TIMEOUT_MS = 5_000
LOOK_HEARTBEAT = timedelta(seconds=10)
UNREACHABLE_S = 10.0
CANCEL_TIMEOUT = timedelta(seconds=5)
_ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)
# Following a task whose agent pushes notifications (requests accepted before this rule never
# had a push handle: they poll as they did).
PATCH_A2A_PUSH = "a2a-push-follow"
PUSH_FIRST_WAIT_S = 10.0
PUSH_MAX_WAIT_S = 300.0
PUSH_LOOK_WINDOW_MS = 1  # one GetTask: the push said when to look
# A look a push woke leaves the poll's backoff alone; looks keep a gap (requests accepted
# before this rule grew the poll's wait with every look, pushed or not).
PATCH_A2A_PUSH_PACE = "a2a-push-pace"
MIN_LOOK_GAP_S = 1.0
# Following a task by its stream (SubscribeToTask) when the agent streams and does not push.
PATCH_A2A_STREAM = "a2a-stream-follow"
SUBSCRIBE_KEY = "subscribe"  # in a look's handle: follow by the stream, not by asking


def capability_queue(capability: str) -> str:
    return f"reach-cap-{capability}"


def wait_before(look: int) -> float:
    """The wait before look `look` (0, 1, ...)."""
    return min(MAX_WAIT_S, FIRST_WAIT_S * GROWTH**look)


def push_wait_before(look: int) -> float:
    """The fallback wait before look `look` when the agent pushes: polling's, but longer."""
    return min(PUSH_MAX_WAIT_S, PUSH_FIRST_WAIT_S * GROWTH**look)


class TaskFollowing:
    """The follow loop, a base of `workflows._attempts.AttemptLoop`, which provides these."""

    _late: LateAnswer | None
    _deadline_ms: int
    _plan: CallPlan
    _cancel_said: str | None  # what became of the agent's task when the request was cancelled
    _pushes: int = 0  # push notifications signalled so far

    @workflow.signal(name=SIGNAL_A2A_PUSH)
    def a2a_pushed(self) -> None:
        """A push notification about the followed task arrived at a gateway: look now."""
        self._pushes += 1

    def _now_ms(self) -> int:
        raise NotImplementedError

    def _envelope(
        self,
        inp: InvokeInput,
        status: RequestStatus,
        *,
        result: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
        instance_id: str | None = None,
    ) -> InvokeResponse:
        raise NotImplementedError

    def _answered_late(self, inp: InvokeInput, instance_id: str | None) -> InvokeResponse:
        raise NotImplementedError

    def _final_reply(self, inp: InvokeInput, reply: Reply, instance_id: str) -> InvokeResponse:
        """The envelope of a final reply (ok, input_required, canceled)."""
        if reply.status == "ok":
            return self._envelope(inp, "success", result=reply.result, instance_id=instance_id)
        status: RequestStatus = "canceled" if reply.status == "canceled" else "input_required"
        return self._envelope(inp, status, result=reply.result or {}, instance_id=instance_id)

    async def _follow_task(
        self, inp: InvokeInput, endpoint: Endpoint, handle: dict[str, Any]
    ) -> InvokeResponse:
        try:
            return await self._follow_loop(inp, endpoint, handle)
        except asyncio.CancelledError:
            # The request was cancelled: ask the agent to stop its task before the request ends
            # canceled, in a step of its own that no cancel reaches.
            if cancel_requested():
                said = await asyncio.shield(self._send_cancel(inp, endpoint, handle))
                self._cancel_said = f"{said} for its task {handle.get('task_id')}"
            raise

    async def _follow_loop(
        self, inp: InvokeInput, endpoint: Endpoint, handle: dict[str, Any]
    ) -> InvokeResponse:
        instance_id = endpoint.instance_id
        look = 0
        unanswered_since: int | None = None
        pushed = handle.get("push") is True and workflow.patched(PATCH_A2A_PUSH)
        subscribe = (
            not pushed and handle.get("stream") is True and workflow.patched(PATCH_A2A_STREAM)
        )
        paced = workflow.patched(PATCH_A2A_PUSH_PACE)
        seen = self._pushes
        polls = 0  # looks the poll's timer woke (paced): its backoff
        poll_at: int | None = None  # when the poll looks next (paced)
        looked_at = self._now_ms()
        while True:
            remaining = self._deadline_ms - self._now_ms()
            if look > 0 and self._late is None and remaining > 0 and paced:
                poll_at, polls = await self._paced_wait(
                    pushed, poll_at, polls, looked_at, remaining, seen
                )
                seen = self._pushes
            elif look > 0 and self._late is None and remaining > 0:
                wait = push_wait_before(look - 1) if pushed else wait_before(look - 1)

                def woken(seen: int = seen) -> bool:  # a late answer, or a push since
                    return self._late is not None or self._pushes != seen

                with contextlib.suppress(builtins.TimeoutError):
                    await workflow.wait_condition(
                        woken,
                        timeout=timedelta(seconds=min(wait, remaining / 1000)),
                    )
                seen = self._pushes
            if self._late is not None:
                return self._answered_late(inp, instance_id)
            remaining = self._deadline_ms - self._now_ms()
            if remaining <= 0:
                return await self._task_past_deadline(inp, endpoint, handle)
            look += 1
            try:
                if subscribe:
                    reply = await self._look(
                        inp, endpoint, {**handle, SUBSCRIBE_KEY: True}, remaining, remaining
                    )
                    # Answered: the task ended, or its stream did first (then: poll from here).
                    subscribe = False
                else:
                    window = PUSH_LOOK_WINDOW_MS if pushed else LOOK_WINDOW_MS
                    reply = await self._look(inp, endpoint, handle, remaining, window)
            except (ActivityError, ApplicationError, TimeoutError) as exc:
                looked_at = self._now_ms()
                error = error_of(exc, instance_id).error
                if error.type not in ("transport_error", "timeout"):
                    return self._envelope(inp, "error", error=error, instance_id=instance_id)
                now = self._now_ms()
                unanswered_since = now if unanswered_since is None else unanswered_since
                if now - unanswered_since < UNREACHABLE_S * 1000:
                    continue
                return self._envelope(
                    inp,
                    "error",
                    error=ErrorInfo(
                        type="transport_error",
                        message=f"agent {instance_id} stopped answering about task "
                        f"{handle.get('task_id')} ({error.message}); it may have run it",
                        retryable=False,
                        outcome_unknown=True,
                    ),
                    instance_id=instance_id,
                )
            unanswered_since = None
            looked_at = self._now_ms()
            if reply.status == "accepted":
                handle = {**handle, **(reply.follow or {})}
                continue
            return self._final_reply(inp, reply, instance_id)

    async def _paced_wait(
        self,
        pushed: bool,
        poll_at: int | None,
        polls: int,
        looked_at: int,
        remaining: int,
        seen: int,
    ) -> tuple[int | None, int]:
        """The wait before a look (`PATCH_A2A_PUSH_PACE`): until the poll is due, a late
        answer, or a push; after a push, until `MIN_LOOK_GAP_S` has passed since the last
        look (`seen`: the pushes counted before it). What the poll's schedule and backoff are
        after it: a look the poll's timer woke grows the backoff, a look a push woke leaves
        both as they were."""
        now = self._now_ms()
        if poll_at is None:
            wait = push_wait_before(polls) if pushed else wait_before(polls)
            poll_at = now + int(wait * 1000)

        def woken() -> bool:  # a late answer, or a push since the last look began
            return self._late is not None or self._pushes != seen

        until_poll = min(poll_at - now, remaining)
        if until_poll > 0:
            with contextlib.suppress(builtins.TimeoutError):
                await workflow.wait_condition(woken, timeout=timedelta(milliseconds=until_poll))
        if self._late is not None:
            return poll_at, polls
        by_push = woken()
        gap = int(MIN_LOOK_GAP_S * 1000) - (self._now_ms() - looked_at)
        left = self._deadline_ms - self._now_ms()
        if gap > 0 and left > 0:
            # Pushes meanwhile are this look's; a late answer still ends the gap at once.
            def late() -> bool:
                return self._late is not None

            with contextlib.suppress(builtins.TimeoutError):
                await workflow.wait_condition(late, timeout=timedelta(milliseconds=min(gap, left)))
        if by_push:
            return poll_at, polls
        return None, polls + 1  # the poll's own look (or the deadline's)

    async def _look(
        self,
        inp: InvokeInput,
        endpoint: Endpoint,
        handle: dict[str, Any],
        remaining_ms: int,
        window_ms: int = LOOK_WINDOW_MS,
    ) -> Reply:
        """One look: a regular activity (scheduling it records the handle before anything
        else happens) that asks about the task for up to a window, polling in process (or,
        its handle saying `SUBSCRIBE_KEY`, holding the task's stream for that window)."""
        window = max(1, min(remaining_ms, window_ms))
        arg = FollowTaskInput(
            endpoint=endpoint,
            handle=handle,
            # One question's own time (a push's look, its window shorter, asks once).
            timeout_ms=max(1, min(remaining_ms, LOOK_TIMEOUT_MS)),
            window_ms=window,
            request_id=inp.request_id,
        )
        queue = capability_queue(inp.target) if inp.plan.mode == "queue" else None
        reply: Reply = await workflow.execute_activity(
            ACTIVITY_FOLLOW_TASK,
            arg,
            result_type=Reply,
            task_queue=queue,
            schedule_to_close_timeout=timedelta(milliseconds=window + LOOK_TIMEOUT_MS),
            heartbeat_timeout=LOOK_HEARTBEAT,
            retry_policy=_ONE_ATTEMPT,
        )
        return reply

    async def _task_past_deadline(
        self, inp: InvokeInput, endpoint: Endpoint, handle: dict[str, Any]
    ) -> InvokeResponse:
        """Ask the agent to stop, then end `timeout` (whatever the cancel's own outcome)."""
        said = await self._send_cancel(inp, endpoint, handle)
        task = handle.get("task_id")
        return self._envelope(
            inp,
            "timeout",
            error=ErrorInfo(
                type="timeout",
                message=f"no answer within timeout_ms={self._plan.timeout_ms}: agent "
                f"{endpoint.instance_id}'s task {task} was still {handle.get('state', 'working')}"
                f" ({said}); it may have run in part or whole",
                retryable=False,
                outcome_unknown=True,
            ),
            instance_id=endpoint.instance_id,
        )

    async def _send_cancel(
        self, inp: InvokeInput, endpoint: Endpoint, handle: dict[str, Any]
    ) -> str:
        """Ask the agent to stop the task `handle` names (`Connector.cancel`): what became of
        the ask, for the request's error message."""
        arg = FollowTaskInput(
            endpoint=endpoint,
            handle=handle,
            timeout_ms=int(CANCEL_TIMEOUT.total_seconds() * 1000),
            request_id=inp.request_id,
        )
        try:
            if inp.plan.mode == "queue":
                await workflow.execute_activity(
                    ACTIVITY_CANCEL_TASK,
                    arg,
                    result_type=bool,
                    task_queue=capability_queue(inp.target),
                    schedule_to_close_timeout=CANCEL_TIMEOUT,
                    retry_policy=_ONE_ATTEMPT,
                )
            else:
                await workflow.execute_local_activity(
                    ACTIVITY_CANCEL_TASK,
                    arg,
                    result_type=bool,
                    schedule_to_close_timeout=CANCEL_TIMEOUT,
                    retry_policy=_ONE_ATTEMPT,
                )
        except (ActivityError, ApplicationError, TimeoutError) as exc:
            workflow.logger.warning("CancelTask failed: %s", exc)
            return "CancelTask failed"
        return "CancelTask was sent"
