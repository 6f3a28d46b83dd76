"""Push notifications from A2A agents (a2a-sdk's own push sender) to Reach's push route, with
a real gateway and dev server: a pushed task ends when the agent says so (the workflow signalled,
one look after), a push that never comes is made up for by the fallback poll, the route refuses
anything without the request's token, and a gateway SIGKILLed while following a pushed task
never sends the message again (the agent's pushes to it fail; the poll finds the end)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client as TemporalClient

from reach.security.a2a_push import PUSH_PATH, SIGNAL_A2A_PUSH, TOKEN_HEADER, push_token
from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, Worker, rid, wait_until

pytestmark = pytest.mark.integration

KEY = "test-push-master-key"
EXTRA = {"REACH_SECURITY__WEBHOOK_KEY": KEY}
# workflows._following's: the fallback poll's first wait when the agent pushes, and the least
# time between two looks.
PUSH_FIRST_WAIT_S = 10.0
MIN_LOOK_GAP_S = 1.0
PUSH_GAP_S = 1.0  # gateway_api._a2a_pushed's: the least time between one gateway's signals


@pytest.fixture(scope="module")
async def pushing(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[GatewayProcess, A2AAgentProcess, A2AAgentProcess]]:
    tmp = tmp_path_factory.mktemp("a2a-push")
    stack = new_stack(temporal_server, tmp, extra=EXTRA)
    on = A2AAgentProcess(tmp, "pusher", push="on")
    lost = A2AAgentProcess(tmp, "lost-pusher", push="lost")
    try:
        async with GatewayProcess(stack) as gateway:
            await on.ready()
            await lost.ready()
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                await register(http, gateway, on.url, "a2a-push-on")
                await register(http, gateway, lost.url, "a2a-push-lost")
            yield gateway, on, lost
    finally:
        on.proc.stop()
        lost.proc.stop()


async def register(http: httpx.AsyncClient, gateway: GatewayProcess, url: str, cap: str) -> None:
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": cap,
            "instance_id": f"{cap}-1",
            "protocol": "a2a",
            "service_address": url,
        },
    )
    assert r.status_code == 200, r.text


async def history_of(temporal: str, request_id: str) -> list[Any]:
    client = await TemporalClient.connect(temporal)
    return [event async for event in client.get_workflow_handle(request_id).fetch_history_events()]


def signals(events: list[Any]) -> int:
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        and e.workflow_execution_signaled_event_attributes.signal_name == SIGNAL_A2A_PUSH
    )


def looks(events: list[Any]) -> int:
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "reach.follow_task"
    )


async def test_a_pushed_task_ends_when_the_agent_says_so(
    pushing: tuple[GatewayProcess, A2AAgentProcess, A2AAgentProcess],
    http: httpx.AsyncClient,
    temporal_server: str,
) -> None:
    gateway, agent, _ = pushing
    before = (await agent.counts())["counts"]
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={
            "target": "a2a-push-on",
            "operation": "slow",
            "payload": {"seconds": 2},
            "timeout_ms": 120_000,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success", body
    assert body["result"]["data"] == [{"done": True, "seconds": 2}]
    events = await history_of(temporal_server, body["request_id"])
    assert signals(events) >= 1  # the agent's notifications reached the workflow
    # Looks: the first (at once, one GetTask), then one per notification at most; the poll
    # alone would have waited PUSH_FIRST_WAIT_S (10 s) before its second look.
    assert looks(events) <= 1 + signals(events), (looks(events), signals(events))
    after = (await agent.counts())["counts"]
    assert after["pushed"] > before.get("pushed", 0)
    assert after["slow"] == before.get("slow", 0) + 1


async def test_a_push_that_never_comes_is_made_up_for_by_the_poll(
    pushing: tuple[GatewayProcess, A2AAgentProcess, A2AAgentProcess],
    http: httpx.AsyncClient,
    temporal_server: str,
) -> None:
    gateway, _, lost = pushing
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={
            "target": "a2a-push-lost",
            "operation": "slow",
            "payload": {"seconds": 1},
            "timeout_ms": 120_000,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success", body
    events = await history_of(temporal_server, body["request_id"])
    assert signals(events) == 0
    assert looks(events) == 2  # the first look, and the fallback poll's after its wait
    assert (await lost.counts())["counts"]["push_lost"] >= 1  # the agent did try


async def test_the_push_route_takes_only_the_request_s_own_token(
    pushing: tuple[GatewayProcess, A2AAgentProcess, A2AAgentProcess], http: httpx.AsyncClient
) -> None:
    gateway, _, _ = pushing
    mine, other = rid(), rid()
    url = f"{gateway.url}{PUSH_PATH}/{mine}"
    for headers in ({}, {TOKEN_HEADER: push_token(KEY, other)}, {TOKEN_HEADER: "x" * 43}):
        r = await http.post(url, json={}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "unauthorized"
        assert TOKEN_HEADER in r.json()["error"]["message"]
    r = await http.post(f"{gateway.url}{PUSH_PATH}/not%20an%20id", json={})
    assert r.status_code == 404, r.text
    # The right token for a request that is not running: taken, nothing to signal.
    r = await http.post(url, json={}, headers={TOKEN_HEADER: push_token(KEY, mine)})
    assert r.status_code == 200, r.text
    assert r.json() == {"request_id": mine, "running": False}


@pytest.mark.slow  # ~30 s: three processes, Temporal's wait before another worker takes over
async def test_a_gateway_sigkilled_while_following_a_pushed_task_never_sends_it_again(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(temporal_server, tmp_path, extra=EXTRA)
    doomed = GatewayProcess(stack, "doomed")  # the door, the worker, and the push route
    survivor = Worker(stack)  # follows the task after the crash; no push reaches it
    agent = A2AAgentProcess(tmp_path, "patient-pusher", push="on")
    try:
        await doomed.ready()
        await survivor.ready()
        await agent.ready()
        await register(http, doomed, agent.url, "a2a-push-patient")
        async with CallbackReceiver() as receiver:
            request_id = rid()
            r = await http.post(
                f"{doomed.url}/reach/invoke",
                json={
                    "request_id": request_id,
                    "target": "a2a-push-patient",
                    "operation": "slow",
                    "payload": {"seconds": 3},
                    "timeout_ms": 90_000,
                    "callback": receiver.url,
                },
            )
            assert r.status_code == 202, r.text

            async def following() -> bool:
                got = await http.get(f"{doomed.url}/reach/requests/{request_id}")
                attempts = got.json().get("attempts") or []
                return bool(attempts) and attempts[0]["outcome"] == "accepted"

            await wait_until(following, 10, every_s=0.05)
            doomed.proc.kill()  # SIGKILL while following the task
            await receiver.wait(1, timeout_s=60)
            assert len(receiver.received) == 1, survivor.proc.output()
            _, body = receiver.received[0]
            assert body["status"] == "success", body
            assert body["result"]["data"] == [{"done": True, "seconds": 3}]
        counts = (await agent.counts())["counts"]
        assert counts["total"] == 1  # the agent's own count: one message, ever
        assert counts["pushed"] >= 1  # and it pushed, to a gateway that was gone
    finally:
        agent.proc.stop()
        survivor.proc.stop()


async def test_a_flood_of_pushes_does_not_make_a_look_each(
    pushing: tuple[GatewayProcess, A2AAgentProcess, A2AAgentProcess],
    http: httpx.AsyncClient,
    temporal_server: str,
) -> None:
    """The request's token in hand (the agent has it, and it never changes), notifications
    without pause while a task runs: each was a signal and a GetTask look, ~8 history events,
    so a few thousand would have pushed the request's history to Temporal's limit (the
    workflow terminated, not answered). A gateway signals one request at most once a second
    (the rest are taken and coalesced); looks are a second apart at least; and a look a push
    woke does not grow the fallback poll's wait: it grew with each (10 s, 15 s, 22 s, ...), so
    pushes that stopped left the end unseen for minutes. The poll's timers are read from the
    history: none is longer than its first wait."""
    gateway, _, _ = pushing
    async with CallbackReceiver() as receiver:
        request_id = rid()
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={
                "request_id": request_id,
                "target": "a2a-push-lost",
                "operation": "slow",
                "payload": {"seconds": 3},
                "timeout_ms": 90_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def following() -> bool:
            got = await http.get(f"{gateway.url}/reach/requests/{request_id}")
            attempts = got.json().get("attempts") or []
            return bool(attempts) and attempts[0]["outcome"] == "accepted"

        await wait_until(following, 20, every_s=0.05)
        url = f"{gateway.url}{PUSH_PATH}/{request_id}"
        headers = {TOKEN_HEADER: push_token(KEY, request_id)}
        codes: list[int] = []

        async def flood() -> None:
            while not receiver.received:
                codes.append((await http.post(url, json={}, headers=headers)).status_code)

        flooding = asyncio.create_task(flood())
        try:
            await receiver.wait(1, timeout_s=60)
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flooding
        assert receiver.received[0][1]["status"] == "success", receiver.received[0][1]
    assert len(codes) > 50, len(codes)
    assert set(codes) <= {200, 202}, set(codes)
    events = await history_of(temporal_server, request_id)
    assert signals(events) <= 20, signals(events)
    # One gateway signals a request at most once a second: a push that came just as its
    # trailing signal was due was signalled as well (two signals ms apart, ~1.5 a second).
    signalled = [
        e.event_time.ToDatetime()
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        and e.workflow_execution_signaled_event_attributes.signal_name == SIGNAL_A2A_PUSH
    ]
    signal_gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(signalled)]
    assert min(signal_gaps, default=1.0) >= PUSH_GAP_S / 2, signal_gaps
    assert looks(events) <= signals(events) + 2, (looks(events), signals(events))
    timers = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for e in events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert timers, events
    assert max(timers) <= PUSH_FIRST_WAIT_S, timers
    scheduled = [
        e.event_time.ToDatetime()
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "reach.follow_task"
    ]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(scheduled)]
    assert gaps, scheduled
    assert min(gaps) >= MIN_LOOK_GAP_S - 0.05, gaps
