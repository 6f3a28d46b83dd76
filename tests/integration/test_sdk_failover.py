"""An SDK agent given several gateways survives the loss of one (issue 25, "Agents survive the
loss of a gateway"): its heartbeats, joins and late answers move to another at once.

Against stand-in gateways over real sockets (each failure in turn: refused, 5xx, hung), and
against two real gateways sharing one Redis registry, the one the agent heartbeats to SIGKILLed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime, RequestContext
from agent_reach_sdk.wire import Answer, Inbound
from gateway_api.devserver import free_port
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, PathServer, wait_until

pytestmark = pytest.mark.integration

SDK = "agent_reach_sdk"
HEARTBEAT_TIMEOUT_S = 3.0


def switches(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unreachable;" in r.getMessage()]


# -- stand-in gateways ----------------------------------------------------------------------------


class StandIn:
    """A gateway's registry and late-answer routes, on a port of its own; `mode` decides how it
    answers ("ok", "503", or "hang": never, until the client gives up)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.mode = "ok"
        self.seen: list[str] = []  # "POST /reach/agents", "PUT .../heartbeat", ...
        self.late: list[bytes] = []
        self.server = PathServer(
            self._handle,
            listen=f"127.0.0.1:{self.port}",
            advertise=f"127.0.0.1:{self.port}",
            instance_id="stand-in",
            max_body_bytes=1 << 20,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, suffix: str) -> int:
        return sum(path.endswith(suffix) for path in self.seen)

    async def _handle(self, request: Inbound) -> Answer:
        self.seen.append(request.operation)
        if self.mode == "503":
            return Answer(503, {"error": {"type": "unavailable", "message": "not now"}})
        if self.mode == "hang":
            await asyncio.sleep(60)
        if request.operation == "/reach/agents":
            return Answer(
                200,
                {
                    "heartbeat_interval": 0.2,
                    "heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
                    "max_message_bytes": 1 << 20,
                },
            )
        if request.operation.endswith("/result"):
            self.late.append(request.body)
            return Answer(202, {"status": "received"})
        return Answer(200, {})

    async def start(self) -> StandIn:
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.close(0)


@pytest.fixture
async def stand_ins() -> AsyncIterator[tuple[StandIn, StandIn]]:
    a, b = StandIn(), StandIn()
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def agent(*addresses: str, **kw: Any) -> AgentRuntime:
    runtime = AgentRuntime(
        "cap",
        reach_address=list(addresses),
        instance_id=f"cap-{uuid.uuid4().hex[:6]}",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.2,
        **kw,
    )

    @runtime.operation("query")
    async def query(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    return runtime


async def test_heartbeats_move_at_once_when_the_gateway_refuses_connections(
    stand_ins: tuple[StandIn, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SDK)
    a, b = stand_ins
    async with agent(a.url, b.url) as runtime:
        await wait_until(lambda: a.count("/heartbeat") >= 2, 5, every_s=0.02)
        assert b.seen == []  # the first address, while it answers
        await a.stop()
        stopped = time.monotonic()
        await wait_until(lambda: b.count("/heartbeat") >= 1, 5, every_s=0.02)
        # The next heartbeat goes to b: no backoff, no join (b shares a's registry).
        assert time.monotonic() - stopped < 1.0
        await wait_until(lambda: b.count("/heartbeat") >= 5, 5, every_s=0.02)
        assert b.count("/reach/agents") == 0
        assert runtime.reach_url == b.url
    assert switches(caplog) == [
        f"gateway {a.url} unreachable; heartbeating via {b.url} ("
        + switches(caplog)[0].split(" (", 1)[1]
    ]
    assert "ConnectError" in switches(caplog)[0]


async def test_a_gateway_answering_5xx_is_passed_over_and_the_next_kept(
    stand_ins: tuple[StandIn, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SDK)
    a, b = stand_ins
    async with agent(a.url, b.url):
        await wait_until(lambda: a.count("/heartbeat") >= 1, 5, every_s=0.02)
        a.mode = "503"
        await wait_until(lambda: b.count("/heartbeat") >= 1, 5, every_s=0.02)
        a.mode = "ok"  # back, but the agent stays where it is (sticky)
        tried_a = len(a.seen)
        await wait_until(lambda: b.count("/heartbeat") >= 6, 5, every_s=0.02)
        assert len(a.seen) == tried_a
    assert len(switches(caplog)) == 1
    assert "HTTP 503" in switches(caplog)[0]


async def test_a_hung_gateway_is_given_up_on_before_the_heartbeat_timeout(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    a, b = stand_ins
    async with agent(a.url, b.url):
        await wait_until(lambda: a.count("/heartbeat") >= 1, 5, every_s=0.02)
        a.mode = "hang"
        hung = time.monotonic()
        await wait_until(lambda: b.count("/heartbeat") >= 1, HEARTBEAT_TIMEOUT_S * 2)
        # The registry would evict after HEARTBEAT_TIMEOUT_S without a heartbeat.
        assert time.monotonic() - hung < HEARTBEAT_TIMEOUT_S


async def test_an_agent_joins_through_the_next_gateway_when_the_first_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=SDK)
    dead, b = StandIn(), await StandIn().start()  # nothing listens on `dead`'s port
    try:
        async with agent(dead.url, b.url) as runtime:
            assert runtime.wait_joined(0)
            assert b.count("/reach/agents") == 1
        assert [m.split(" (")[0] for m in switches(caplog)] == [
            f"gateway {dead.url} unreachable; joining via {b.url}"
        ]
    finally:
        await b.stop()


async def test_a_late_answer_is_resent_to_the_next_gateway_not_lost(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    a, b = stand_ins
    async with agent(a.url, b.url) as runtime:
        await a.stop()
        sent = time.monotonic()
        await runtime.send_result("r-late", {"answer": 42})
        assert time.monotonic() - sent < 0.5  # at once, not after a backoff
    assert [json.loads(body) for body in b.late] == [
        {"instance_id": runtime.instance_id, "status": "success", "result": {"answer": 42}}
    ]
    assert a.late == []


async def test_a_late_answer_waits_with_backoff_until_a_gateway_is_back() -> None:
    a, b = StandIn(), StandIn()  # neither is listening yet
    runtime = agent(a.url, b.url)  # not started: a process answering an old request
    sending = asyncio.create_task(runtime.send_result("r-old", {"answer": 1}))
    await asyncio.sleep(0.8)  # a round or two of both refusing
    assert not sending.done()
    await b.start()
    try:
        await asyncio.wait_for(sending, 10)
        assert len(b.late) == 1
    finally:
        await b.stop()


async def test_one_gateway_is_called_as_before(
    stand_ins: tuple[StandIn, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=SDK)
    a, _ = stand_ins
    async with agent(a.url) as runtime:
        assert runtime.reach_urls == (a.url,)
        await wait_until(lambda: a.count("/heartbeat") >= 1, 5, every_s=0.02)
        a.mode = "503"
        await wait_until(lambda: a.count("/heartbeat") >= 3, 5, every_s=0.02)
    assert switches(caplog) == []
    assert not any("every gateway failed" in r.getMessage() for r in caplog.records)


async def test_when_every_gateway_fails_the_one_that_answers_is_tried_first(
    stand_ins: tuple[StandIn, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SDK)
    a, b = stand_ins
    async with agent(a.url, b.url) as runtime:
        await wait_until(lambda: a.count("/heartbeat") >= 1, 5, every_s=0.02)
        b.mode = "503"  # b answers, if only to say "not now"; a then dies
        await a.stop()
        # b's first heartbeat arrives before the SDK has read its answer: wait for the choice.
        await wait_until(lambda: b.count("/heartbeat") >= 1, 5, every_s=0.02)
        await wait_until(lambda: runtime.reach_url == b.url, 5, every_s=0.02)  # not the dead one
        b.mode = "ok"
        await wait_until(lambda: b.count("/heartbeat") >= 4, 5, every_s=0.02)
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("every gateway failed")]) == 1
    assert f"gateway {b.url} answers again; heartbeating via it" in said
    assert len(switches(caplog)) == 1


# -- two real gateways on one Redis registry ------------------------------------------------------


@pytest.mark.parametrize(
    "moves_first", ["sending late answers", "heartbeating"], ids=["late-answer", "heartbeat"]
)
async def test_an_agent_outlives_the_gateway_it_heartbeats_to(
    moves_first: str,
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    capability: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=SDK)
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    # The workflows run on b's worker: what dies with a is the door the agent talks to (a
    # worker's own recovery after a SIGKILL is another test's business).
    a, b = GatewayProcess(stack, "a", worker=False), GatewayProcess(stack, "b")
    try:
        await asyncio.gather(a.ready(), b.ready())
        await _outlive(a, b, stack.heartbeat_timeout, capability, caplog, moves_first)
    finally:
        a.proc.stop()
        b.proc.stop()


async def _outlive(
    a: GatewayProcess,
    b: GatewayProcess,
    heartbeat_timeout: float,
    capability: str,
    caplog: pytest.LogCaptureFixture,
    moves_first: str,
) -> None:
    """The agent heartbeats to `a`; `a` is SIGKILLed with a late answer owed. Either the late
    answer is sent at once (its post finds `a` dead and moves the agent to `b`), or after the
    eviction window (the heartbeats find `a` dead first)."""
    instance_id = f"{capability}-failover"
    runtime = AgentRuntime(
        capability,
        reach_address=f"{a.url},{b.url}",
        instance_id=instance_id,
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
    )
    accepted: asyncio.Queue[str] = asyncio.Queue()

    @runtime.operation("query")
    async def query(payload: dict[str, Any]) -> dict[str, Any]:
        return {"echo": payload}

    @runtime.operation("later")
    async def later(payload: dict[str, Any], ctx: RequestContext) -> object:
        accepted.put_nowait(ctx.request_id)
        return ctx.defer()

    async with httpx.AsyncClient(trust_env=False, timeout=90) as http:

        async def instances() -> list[dict[str, Any]]:
            r = await http.get(f"{b.url}/reach/capabilities/{capability}")
            return list(r.json()["instances"]) if r.status_code == 200 else []

        async with runtime:
            assert runtime.reach_url == a.url
            await wait_until(lambda: _listed(instances(), instance_id), 10)
            waiting = asyncio.create_task(
                http.post(
                    f"{b.url}/reach/invoke",
                    json={"target": capability, "operation": "later", "timeout_ms": 60_000},
                )
            )
            request_id = await asyncio.wait_for(accepted.get(), 30)

            a.proc.kill()
            await wait_until(lambda: _refused(a.port), 10, every_s=0.002)
            killed = time.monotonic()
            # Posted to a first (it is the gateway the agent talks to), then at once to b; b
            # may ask for it again while a's worker's workflow task times out.
            answer = runtime.send_result(request_id, {"answered": "after a died"})
            answering = asyncio.ensure_future(answer) if moves_first != "heartbeating" else None

            # Routable all along, for twice as long as the registry waits before it evicts.
            while time.monotonic() - killed < 2 * heartbeat_timeout:
                listed = await instances()
                fresh = [
                    i["instance_id"]
                    for i in listed
                    if i["status"] != "unhealthy"
                    and time.time() - i["last_seen"] < heartbeat_timeout
                ]
                assert fresh == [instance_id], (
                    f"{time.monotonic() - killed:.1f}s after the kill: {listed}"
                )
                await asyncio.sleep(0.2)
            assert runtime.reach_url == b.url
            await asyncio.wait_for(answering or answer, 90)

            r = await http.post(
                f"{b.url}/reach/invoke",
                json={"target": capability, "operation": "query", "payload": {"n": 1}},
            )
            assert r.status_code == 200, r.text
            assert r.json()["result"] == {"echo": {"n": 1}}

            late = await asyncio.wait_for(waiting, 75)
            assert late.status_code == 200, late.text
            assert late.json()["request_id"] == request_id
            assert late.json()["result"] == {"answered": "after a died"}

    moved = switches(caplog)
    assert len(moved) == 1, moved
    # The late answer's post usually finds a dead first; a heartbeat may beat it by a hair.
    lines = {f"gateway {a.url} unreachable; {v} via {b.url}" for v in (moves_first, "heartbeating")}
    assert moved[0].split(" (", 1)[0] in lines


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def _listed(listed: Any, instance_id: str) -> bool:
    return any(i["instance_id"] == instance_id for i in await listed)
