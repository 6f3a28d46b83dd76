"""Record InvokeWorkflow histories for the replay test.

    python -m tests.histories.record            # record the cases that have no file yet
    python -m tests.histories.record NAME ...   # (re-)record these cases

Runs the workflow against a fresh dev server with scripted activities (replay never runs
activities, so their stand-ins only shape the history) and writes one JSON file per path.
Re-record only on purpose: the committed files are what requests in flight look like, and the
oldest ones (e.g. `callback`, from before callbacks had a workflow of their own; `late-answer`,
from before late answers were an update) keep the old code paths honest.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.worker import Worker

from gateway_api.devserver import DevServer, free_port
from gateway_api.engine import failed_outcome
from reach.invocation import (
    BucketPlan,
    CallbackInput,
    CallInput,
    CallPlan,
    ClaimInput,
    ClaimOutcome,
    Endpoint,
    FollowTaskInput,
    InvokeInput,
    LateAnswer,
    PinQuery,
    QueuePlan,
    ResolveInput,
    TakeInput,
    delivery_workflow_id,
)
from reach.messages import Reply
from reach.security.a2a_push import SIGNAL_A2A_PUSH
from workflows.callback import DeliverCallbackWorkflow
from workflows.invoke import InvokeWorkflow

HERE = Path(__file__).parent
QUEUE = "record"


SEEN: set[str] = set()


def first_time(what: str) -> bool:
    if what in SEEN:
        return False
    SEEN.add(what)
    return True


@activity.defn(name="reach.resolve")
async def resolve(inp: ResolveInput) -> Endpoint:
    if inp.operation == "lostrun":  # the store stays away: this run never routes it
        raise ApplicationError(
            "store away", {"retryable": True}, type="unavailable", non_retryable=True
        )
    if inp.operation == "outage" and first_time(f"resolve-{inp.request_id}"):
        raise ApplicationError(
            "store away", {"retryable": True}, type="unavailable", non_retryable=True
        )
    n = len(inp.exclude)
    return Endpoint(instance_id=f"i{n}", capability=inp.capability, protocol="http", address="x")


@activity.defn(name="reach.pinned")
async def pinned(request_id: str) -> str:
    return "i0"


@activity.defn(name="reach.pinned_attempt")
async def pinned_attempt(inp: PinQuery) -> str:
    """Another run's pin of the attempt: one for the `-read-pin` cases (a lost task sent it)."""
    return "i0" if inp.request_id.endswith("-read-pin") else ""


@activity.defn(name="reach.claim_key")
async def claim_key(inp: ClaimInput) -> ClaimOutcome:
    if inp.request_id.endswith("lost-claim-read-pin"):  # the store stays away
        raise ApplicationError(
            "store away", {"retryable": True}, type="unavailable", non_retryable=True
        )
    return ClaimOutcome(owner=inp.request_id, same_request=True)


@activity.defn(name="reach.release_key")
async def release_key(inp: ClaimInput) -> bool:
    return True


@activity.defn(name="reach.release_route")
async def release_route(request_id: str) -> bool:
    return True


@activity.defn(name="reach.take_token")
async def take_token(inp: TakeInput) -> float:
    wait = 30.0 if inp.buckets[0].key in LONG_WAITS else 0.2  # a long one: cancelled in it
    return wait if first_time(f"take-{inp.buckets[0].key}") else 0.0


LONG_WAITS = {"cap:cancel-rate-wait"}


@activity.defn(name="reach.call")
async def call(inp: CallInput) -> Reply:
    op = inp.message.header.operation
    if op == "stale" and inp.check_first:
        raise ApplicationError("the instance left", type="stale_route", non_retryable=True)
    if op == "flaky" and inp.message.header.attempt == 1:
        raise ApplicationError(
            "refused", {"retryable": True}, type="transport_error", non_retryable=True
        )
    if op == "broken" and first_time(f"call-{inp.message.header.request_id}"):
        raise ApplicationError(
            "broke mid-call",
            {"retryable": True, "outcome_unknown": True},
            type="transport_error",
            non_retryable=True,
        )
    if op == "unsent" and first_time(f"call-{inp.message.header.request_id}"):
        raise ApplicationError(  # the send-once claim met the store away: nothing was sent
            "attempt 1 was not sent to i0: the store is away",
            {"retryable": True, "not_sent": True},
            type="unavailable",
            non_retryable=True,
        )
    if op == "claimed":  # another run holds the attempt's send-once claim: refused unsent
        raise ApplicationError(
            "attempt 1 was sent to i0 by a run whose Reach process stopped",
            {"retryable": False, "outcome_unknown": True, "not_sent": True},
            type="transport_error",
            non_retryable=True,
        )
    if op == "refuse":
        raise ApplicationError(
            "agent knowledge-retriever-1 refused: index_missing",
            {"retryable": False},
            type="agent_error",
            non_retryable=True,
        )
    if op == "defer":
        return Reply(status="accepted")
    if op == "task":  # an A2A agent's task, still working: followed by handle
        return Reply(status="accepted", follow=dict(TASK, state="submitted"))
    if op == "pushtask":  # the same, its agent pushing notifications about it
        return Reply(status="accepted", follow=dict(TASK, state="submitted", push=True))
    if op == "streamtask":  # the same, its agent streaming and not pushing
        return Reply(status="accepted", follow=dict(TASK, state="submitted", stream=True))
    if op == "slow":
        await asyncio.sleep(inp.timeout_ms / 1000 + 0.5)
    return Reply(status="ok", result={"answer": 42})


TASK = {"task_id": "task-1", "context_id": "ctx-1", "url": "http://x/", "state": "working"}


# Looks that find the task still working before one finds it done (1 unless named here).
LOOKS_WORKING = {"replay-a2a-push-paced": 2}


@activity.defn(name="reach.follow_task")
async def follow_task(inp: FollowTaskInput) -> Reply:
    """The first look finds the task still working (a timer, then another look); done. A
    look by the task's stream finds it done, unless its stream is cut (`-cut`)."""
    if inp.handle.get("subscribe") is True and not inp.request_id.endswith("-cut"):
        return Reply(status="ok", result={"answer": 42})
    LOOKED[inp.request_id] = LOOKED.get(inp.request_id, 0) + 1
    if LOOKED[inp.request_id] <= LOOKS_WORKING.get(inp.request_id, 1):
        return Reply(status="accepted", follow=TASK)
    return Reply(status="ok", result={"answer": 42})


LOOKED: dict[str, int] = {}


@activity.defn(name="reach.cancel_task")
async def cancel_task(inp: FollowTaskInput) -> bool:
    return True


@activity.defn(name="reach.deliver_callback")
async def deliver_callback(inp: CallbackInput) -> int:
    return 1


def _input(name: str, operation: str, **kw: Any) -> InvokeInput:
    now = int(time.time() * 1000)
    timeout = kw.pop("timeout_ms", 5000)
    plan = CallPlan(timeout_ms=timeout, idempotent=True, max_retries=2)
    if kw.pop("queue_mode", False):  # its call waits on a queue no worker here serves
        plan.mode = "queue"
    if kw.pop("queue", False):
        bucket = BucketPlan(key=f"cap:{name}", per_minute=60, capacity=1)
        plan.queue = QueuePlan(buckets=[bucket], wait_until_ms=now + timeout)
    return InvokeInput(
        request_id=f"replay-{name}",
        caller="recorder",
        target="knowledge-retriever",
        operation=operation,
        payload={"text": "hello"},
        accepted_at_ms=now,
        deadline_ms=now + timeout,
        plan=plan,
        **kw,
    )


DOOR: dict[str, Any] = {
    "endpoint": Endpoint(
        instance_id="door", capability="knowledge-retriever", protocol="http", address="x"
    ),
    "status_at_start": "success",
}

CASES = {
    "success": ("query", {}),
    "retry": ("flaky", {}),
    "timeout": ("slow", {"timeout_ms": 300}),
    "late-answer-update": ("defer", {}),
    "callback-workflow": ("query", {"callback": "http://127.0.0.1:1/cb"}),
    # The delivery workflow's own history (DELIVERY): its POST scheduled with a heartbeat
    # timeout (PATCH_CALLBACK_HEARTBEAT); `-before`, recorded before that patch, without one.
    "callback-delivery": ("query", {"callback": "http://127.0.0.1:1/cb"}),
    # The policy engine's paths: an idempotency key claimed (a failure frees it), a wait for
    # a rate-limit token, a store outage at routing waited out.
    "idempotency-key": ("flaky", {"idempotency_key": "order-1"}),
    "rate-limit-queue": ("query", {"queue": True}),
    "store-outage": ("outage", {}),
    "redeliver": ("broken", {}),
    # A call refused unsent (another run's send-once claim): reported, not re-delivered
    # (PATCH_NOT_SENT).
    "not-sent": ("claimed", {}),
    # A call refused unsent (its send-once claim met the store away): waited for, and the same
    # attempt resolved again, its pin claimed again on a key of its own (PATCH_PIN_CLAIMS).
    "unsent-again": ("unsent", {}),
    # Attempt 1 after a lost run (its first task's history longer than a first task's: here a
    # signal came with the start): the store away until the deadline; the lost run is
    # remembered (PATCH_LOST_RUN) and named from the pin at the end (PATCH_NAME_LOST_LATER).
    "lost-run": ("lostrun", {"timeout_ms": 2500}),
    # After a lost first task (a signal came with the start), the idempotency key's claim
    # meets the store away until the deadline: attempt 1's pin is read (PATCH_LOST_FIRST_TASK),
    # another run's, so the lost task may have sent it: a timeout, outcome unknown, naming i0.
    "lost-claim-read-pin": ("query", {"idempotency_key": "order-2", "timeout_ms": 2500}),
    # The store outage at routing, recorded after an inline resolve's failure left its pin
    # claim unsure (PATCH_PIN_UNSURE): the next claim goes on the same key again.
    "store-outage-unsure": ("outage", {}),
    # Cancelled while waiting for a rate-limit token, no call in flight: the attempt's pin is
    # read for a lost task's send (PATCH_CANCEL_READS_PIN); none here, so plainly canceled.
    "cancel-rate-wait": ("query", {"queue": True, "timeout_ms": 60_000}),
    # Attempt 1 routed at the door: one call; the instance left first; a retry elsewhere.
    "door-routed": ("query", DOOR),
    "door-stale": ("stale", DOOR),
    "door-retry": ("flaky", DOOR),
    "door-deadline": ("query", {**DOOR, "timeout_ms": 1}),
    # An error or a timeout fails the workflow, its envelope the failure's detail (its
    # callback handed to delivery first).
    "failed-error": ("refuse", {**DOOR, "callback": "http://127.0.0.1:1/cb"}),
    "failed-timeout": ("slow", {"timeout_ms": 300}),
    # An A2A task followed by its handle: a look, a timer, a look that finds it done.
    "a2a-task": ("task", {**DOOR, "timeout_ms": 10_000}),
    # A workflow cancel (A2A CancelTask, MCP tasks/cancel) while the request waits: on a
    # queue-mode call, and on the timer between two looks at an A2A task (the agent is asked
    # to stop); both end canceled. The `-before` ones were recorded with the code before that
    # rule (the call read as internal; cancelled on a timer, no result) and keep that path
    # honest: re-recording them today would record the new path.
    "cancel-queued-call": ("query", {**DOOR, "queue_mode": True}),
    "cancel-a2a-task": ("task", {**DOOR, "timeout_ms": 10_000}),
    # An A2A task whose agent pushes: a look, a wait a push notification (a signal) ends
    # before its timer fires, a look that finds it done (PATCH_A2A_PUSH).
    "a2a-push": ("pushtask", {**DOOR, "timeout_ms": 60_000}),
    # Pushes in a flood (PATCH_A2A_PUSH_PACE): two at once wake one look, which waits out the
    # gap between looks first; the poll's next wait is the rest of its schedule, not longer;
    # another push, another gap, a look that finds it done.
    "a2a-push-paced": ("pushtask", {**DOOR, "timeout_ms": 60_000}),
    # A task followed by its stream (PATCH_A2A_STREAM): one look that holds the stream and
    # finds it done; and one whose stream is cut: a timer, then a poll's look.
    "a2a-stream": ("streamtask", {**DOOR, "timeout_ms": 60_000}),
    "a2a-stream-cut": ("streamtask", {**DOOR, "timeout_ms": 60_000}),
}
# Each pushed case: the events (type, how many of them) after which pushes are signalled
# (each signalled as many times as listed).
PUSH_AT: dict[str, list[tuple[str, int, int]]] = {
    "a2a-push": [("EVENT_TYPE_TIMER_STARTED", 1, 1)],
    "a2a-push-paced": [("EVENT_TYPE_TIMER_STARTED", 1, 2), ("EVENT_TYPE_TIMER_STARTED", 3, 1)],
}
# Cases started with a signal (a push notification: it changes nothing before a task is
# followed), so that their first task finds more than a first task's events.
START_SIGNAL = {"lost-run": SIGNAL_A2A_PUSH, "lost-claim-read-pin": SIGNAL_A2A_PUSH}
# Cases whose file is the history of the request's delivery workflow, not its own.
DELIVERY = {"callback-delivery"}
# Each cancel case: the event it waits for before it cancels.
CANCEL_AT = {
    "cancel-queued-call": "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED",
    "cancel-a2a-task": "EVENT_TYPE_TIMER_STARTED",
    "cancel-rate-wait": "EVENT_TYPE_TIMER_STARTED",
}


async def cancel_at(handle: Any, event_type: str) -> None:
    """Cancel the workflow as soon as its history holds an `event_type` event."""
    wanted = getattr(EventType, event_type)
    for _ in range(200):
        async for event in handle.fetch_history_events():
            if event.event_type == wanted:
                await handle.cancel(reason="recorded cancel")
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {event_type} to cancel at")


async def push_at(handle: Any, event_type: str, nth: int = 1, times: int = 1) -> None:
    """Signal `times` push notifications as soon as the history holds `nth` `event_type`
    events."""
    wanted = getattr(EventType, event_type)
    for _ in range(400):
        seen = 0
        async for event in handle.fetch_history_events():
            seen += event.event_type == wanted
        if seen >= nth:
            for _ in range(times):
                await handle.signal(SIGNAL_A2A_PUSH)
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {nth} {event_type} to push at")


async def main(names: list[str]) -> None:
    port = free_port()
    server = DevServer(str(HERE / ".record.db"), port, None)
    server.start()
    try:
        client = await Client.connect(f"127.0.0.1:{port}", data_converter=pydantic_data_converter)
        async with Worker(
            client,
            task_queue=QUEUE,
            workflows=[InvokeWorkflow, DeliverCallbackWorkflow],
            activities=[
                cancel_task,
                follow_task,
                resolve,
                call,
                deliver_callback,
                claim_key,
                release_key,
                take_token,
                release_route,
                pinned,
                pinned_attempt,
            ],
        ):
            for name in names:
                operation, extra = CASES[name.removesuffix("-before")]
                inp = _input(name, operation, **extra)
                handle = await client.start_workflow(
                    InvokeWorkflow.run,
                    inp,
                    id=inp.request_id,
                    task_queue=QUEUE,
                    start_signal=START_SIGNAL.get(name),
                )
                if name.removesuffix("-before") in CANCEL_AT:
                    await cancel_at(handle, CANCEL_AT[name.removesuffix("-before")])
                for event_type, nth, times in PUSH_AT.get(name, []):
                    await push_at(handle, event_type, nth, times)
                if operation == "defer":
                    await asyncio.sleep(0.3)
                    await handle.execute_update(
                        InvokeWorkflow.submit_late_answer,
                        LateAnswer(status="success", result={"late": True}),
                    )
                try:
                    result = await handle.result()
                except WorkflowFailureError as exc:
                    carries = failed_outcome(exc.cause)
                    if carries is None and not isinstance(exc.cause, CancelledError):
                        raise
                    result = carries or Reply(status="canceled")
                if name.removesuffix("-before") in DELIVERY:
                    handle = client.get_workflow_handle(delivery_workflow_id(inp.request_id))
                    print(f"{name}: delivery {await handle.result()}")
                history = await handle.fetch_history()
                (HERE / f"{name}.json").write_text(history.to_json())
                print(f"{name}: {result.status}")
    finally:
        server.stop()
        for leftover in HERE.glob(".record.db*"):
            leftover.unlink()


if __name__ == "__main__":
    chosen = sys.argv[1:] or [n for n in CASES if not (HERE / f"{n}.json").exists()]
    asyncio.run(main(chosen))
