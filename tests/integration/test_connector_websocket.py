"""The WebSocket connector against the SDK's WebSocket server and hand-written agents.

Real sockets throughout: an `AgentRuntime` behind `WebSocketAgentServer` (in this process, or in
a process of its own to SIGKILL), raw `websockets` servers that send exactly the frames a
misbehaving agent would, and raw clients that send the SDK server what Reach never would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

import agent_reach_sdk.servers.websocket as ws_server
import connectors.websocket as ws_connector
from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.context import RequestContext
from agent_reach_sdk.runtime import OperationError
from agent_reach_sdk.servers.websocket import WebSocketAgentServer
from connectors.websocket import WebSocketConnector
from reach.config import TransportSettings
from reach.errors import AgentError, DeadlineExceeded, TransportError
from reach.invocation import Endpoint
from tests.helpers import free_port, message, spawn, wait_until

pytestmark = pytest.mark.integration

CAPABILITY = "cap"  # where helpers.message sends


def endpoint(address: str, max_message_bytes: int | None = None, name: str = "ws-1") -> Endpoint:
    return Endpoint(
        instance_id=name,
        capability=CAPABILITY,
        protocol="websocket",
        address=address,
        max_message_bytes=max_message_bytes,
    )


def counters(conn: WebSocketConnector) -> dict[str, int]:
    return conn.stats.of(CAPABILITY).get("websocket", {})


# -- an SDK agent in this process -----------------------------------------------------------------


class Agent:
    """An `AgentRuntime` (never joined) served by `WebSocketAgentServer` on a free port."""

    def __init__(
        self, name: str = "ws-1", max_message_bytes: int = 1 << 20, listen: str = "127.0.0.1:0"
    ) -> None:
        self.name = name
        self.runtime = AgentRuntime(
            CAPABILITY,
            protocol="websocket",
            instance_id=name,
            max_message_bytes=max_message_bytes,
        )
        self.seen: list[RequestContext] = []
        self.server = WebSocketAgentServer(
            self.runtime.dispatch,
            listen=listen,
            advertise=listen,
            instance_id=name,
            max_body_bytes=max_message_bytes,
        )
        op = self.runtime.operation

        @op("echo")
        async def echo(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
            self.seen.append(ctx)
            await asyncio.sleep(float(payload.get("sleep", 0)))
            return {"got": payload, "request_id": ctx.request_id}

        @op("later")
        async def later(payload: dict[str, Any], ctx: RequestContext) -> Any:
            return ctx.defer()

        @op("big")
        async def big(payload: dict[str, Any]) -> dict[str, Any]:
            return {"pad": "x" * int(payload["size"])}

        @op("busy")
        async def busy(payload: dict[str, Any]) -> dict[str, Any]:
            raise OperationError("come back later", type="busy", status=503)

        @op("refuse")
        async def refuse(payload: dict[str, Any]) -> dict[str, Any]:
            raise OperationError("q must be a number", type="bad_input", status=422)

        @op("crash")
        async def crash(payload: dict[str, Any]) -> dict[str, Any]:
            raise RuntimeError("boom")

    def endpoint(self, max_message_bytes: int | None = None) -> Endpoint:
        return endpoint(self.server.service_address, max_message_bytes, name=self.name)

    async def __aenter__(self) -> Agent:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close(grace_s=1)


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    async with Agent() as a:
        yield a


async def test_results_metadata_and_the_status_table(agent: Agent) -> None:
    ep = agent.endpoint()
    async with WebSocketConnector() as conn:
        reply = await conn.invoke(ep, message("echo", request_id="req-1"), 2)
        assert reply.status == "ok"
        assert reply.result == {"got": {"q": "x"}, "request_id": "req-1"}
        ctx = agent.seen[-1]
        assert (ctx.request_id, ctx.caller, ctx.attempt) == ("req-1", "tester", 2)
        assert ctx.idempotency_key == "key-1"
        assert ctx.headers["traceparent"].startswith("00-4bf92f35")
        assert ctx.deadline_ms is not None
        assert ctx.deadline_ms > time.time() * 1000
        assert (await conn.invoke(ep, message("later", request_id="req-2"), 2)).status == (
            "accepted"
        )
        with pytest.raises(AgentError) as missing:
            await conn.invoke(ep, message("nope", request_id="req-3"), 2)
        assert not missing.value.retryable
        assert "operation not served" in missing.value.message
        with pytest.raises(AgentError) as busy:
            await conn.invoke(ep, message("busy", request_id="req-4"), 2)
        assert busy.value.retryable
        assert busy.value.fault is not None
        assert (busy.value.fault.type, busy.value.fault.status) == ("busy", 503)
        assert "answered 503" in busy.value.message
        with pytest.raises(AgentError) as refused:
            await conn.invoke(ep, message("refuse", request_id="req-5"), 2)
        assert not refused.value.retryable
        with pytest.raises(AgentError) as crashed:
            await conn.invoke(ep, message("crash", request_id="req-6"), 2)
        assert crashed.value.retryable
        # Every outcome above travelled on the one connection.
        assert counters(conn)["opened"] == 1
        assert agent.server.accepted == 1


async def test_the_payload_arrives_as_reach_measured_it(agent: Agent) -> None:
    payload = {"text": "日本語, é, 🙂 " * 500, "n": [1.5, None, True]}
    async with WebSocketConnector() as conn:
        reply = await conn.invoke(agent.endpoint(), message("echo", payload), 2)
    assert reply.result is not None
    assert reply.result["got"] == payload


async def test_twenty_requests_at_once_share_one_connection(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        replies = await asyncio.gather(
            *(
                conn.invoke(
                    agent.endpoint(),
                    message("echo", {"i": i, "sleep": 0.2}, request_id=f"r-{i}"),
                    5,
                )
                for i in range(20)
            )
        )
        assert [r.result["got"]["i"] for r in replies if r.result] == list(range(20))
        assert [r.result["request_id"] for r in replies if r.result] == [
            f"r-{i}" for i in range(20)
        ]
        stats = counters(conn)
        assert (stats["opened"], stats["reused"], stats["failed"]) == (1, 19, 0)
        assert agent.server.accepted == 1
        assert agent.server.connection_count == 1


async def test_a_fast_request_overtakes_a_slow_one_on_the_same_connection(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        ep = agent.endpoint()
        done: list[str] = []

        async def call(name: str, sleep: float) -> Any:
            reply = await conn.invoke(ep, message("echo", {"sleep": sleep}, request_id=name), 5)
            done.append(name)
            return reply.result

        slow = asyncio.create_task(call("slow", 0.6))
        await asyncio.sleep(0.05)
        fast = [await call(f"fast-{i}", 0) for i in range(3)]
        assert done == ["fast-0", "fast-1", "fast-2"]
        assert [r["request_id"] for r in fast] == ["fast-0", "fast-1", "fast-2"]
        assert (await slow)["request_id"] == "slow"
        assert done[-1] == "slow"
        assert agent.server.accepted == 1


async def test_a_deadline_ends_the_call_and_leaves_nothing_waiting(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        ep = agent.endpoint()
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(ep, message("echo", {"sleep": 30}, request_id="slow"), 0.3)
        assert 0.25 < time.monotonic() - start < 5.0  # at its deadline, not the agent's 30 s
        assert conn.waiting() == 0
        # The late reply is dropped when it comes; the connection serves on.
        reply = await conn.invoke(ep, message("echo", request_id="after"), 2)
        assert reply.result is not None
        assert reply.result["request_id"] == "after"
        assert counters(conn)["opened"] == 1


async def test_a_redelivered_request_runs_once(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        ep = agent.endpoint()
        first = await conn.invoke(ep, message("echo", {"n": 1}, request_id="again"), 2)
        second = await conn.invoke(ep, message("echo", {"n": 1}, request_id="again"), 2)
        assert first.result == second.result
        assert agent.runtime.executed == 1
        # Two attempts of one request in flight together: both answered, the operation run once.
        both = await asyncio.gather(
            conn.invoke(ep, message("echo", {"sleep": 0.3}, request_id="twice"), 2),
            conn.invoke(ep, message("echo", {"sleep": 0.3}, request_id="twice", attempt=3), 2),
        )
        assert both[0].result == both[1].result
        assert agent.runtime.executed == 2
        assert conn.waiting() == 0


async def test_a_reply_over_the_limit_fails_that_request_alone(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        ep = agent.endpoint(max_message_bytes=4096)
        with pytest.raises(AgentError) as err:
            await conn.invoke(ep, message("big", {"size": 10_000}), 2)
        assert not err.value.retryable
        assert "the limit is 4096" in err.value.message
        ok = await conn.invoke(ep, message("big", {"size": 4000}, request_id="fits"), 2)
        assert ok.status == "ok"
        assert (counters(conn)["opened"], agent.server.accepted) == (1, 1)


async def test_the_configured_limit_applies_when_none_was_negotiated(agent: Agent) -> None:
    async with WebSocketConnector(TransportSettings(max_message_bytes=4096)) as conn:
        with pytest.raises(AgentError, match="the limit is 4096"):
            await conn.invoke(agent.endpoint(), message("big", {"size": 5000}), 2)


async def test_a_path_without_a_websocket_endpoint_is_refused_at_the_handshake(
    agent: Agent,
) -> None:
    wrong = endpoint(f"ws://127.0.0.1:{agent.server.port}/elsewhere")
    async with WebSocketConnector() as conn:
        with pytest.raises(TransportError) as err:
            await conn.invoke(wrong, message("echo"), 2)
        # Asked again during the backoff: the same final refusal, not a retryable one.
        with pytest.raises(TransportError) as again:
            await conn.invoke(wrong, message("echo"), 2)
    assert not err.value.retryable
    assert "HTTP 404" in err.value.message
    assert not again.value.retryable
    assert "next connect attempt in" in again.value.message
    assert agent.server.accepted == 0


async def test_a_redirect_is_not_followed(agent: Agent) -> None:
    target = f"ws://127.0.0.1:{agent.server.port}/reach"

    def redirect(connection: ServerConnection, request: Request) -> Response:
        response = connection.respond(HTTPStatus.MOVED_PERMANENTLY, "moved\n")
        response.headers["Location"] = target
        return response

    async with (
        serve(_unused, "127.0.0.1", 0, process_request=redirect) as mover,
        WebSocketConnector() as conn,
    ):
        port = mover.sockets[0].getsockname()[1]
        with pytest.raises(TransportError) as err:
            await conn.invoke(endpoint(f"127.0.0.1:{port}"), message("echo"), 2)
    assert not err.value.retryable
    assert "HTTP 301" in err.value.message
    assert agent.server.accepted == 0


async def _unused(ws: ServerConnection) -> None:
    raise AssertionError("the handshake was redirected")


async def test_the_advertised_url_form_is_served_and_callable() -> None:
    runtime = AgentRuntime(CAPABILITY, protocol="websocket", instance_id="url-form")

    @runtime.operation("ping")
    async def ping(payload: dict[str, Any]) -> dict[str, Any]:
        return {"pong": True}

    server = WebSocketAgentServer(
        runtime.dispatch,
        listen="127.0.0.1:0",
        advertise="ws://127.0.0.1:0/agents/a1",
        instance_id="url-form",
        max_body_bytes=1 << 20,
    )
    await server.start()
    try:
        address = server.service_address
        assert address == f"ws://127.0.0.1:{server.port}/agents/a1"
        assert WebSocketConnector.check_address(address) == address
        async with WebSocketConnector() as conn:
            reply = await conn.invoke(endpoint(address), message("ping"), 2)
        assert reply.result == {"pong": True}
    finally:
        await server.close()


# -- idle reclaim, forget, backoff ---------------------------------------------------------------


async def test_an_idle_connection_is_reclaimed(agent: Agent) -> None:
    async with WebSocketConnector(TransportSettings(idle_timeout_s=0.3)) as conn:
        await conn.invoke(agent.endpoint(), message("echo"), 2)
        assert agent.server.connection_count == 1
        await wait_until(lambda: agent.server.connection_count == 0, 3)
        assert conn.held() == {}
        stats = counters(conn)
        assert (stats["reclaimed"], stats["failed"]) == (1, 0)
        await conn.invoke(agent.endpoint(), message("echo", request_id="req-2"), 2)
        assert agent.server.accepted == 2


async def test_forget_closes_the_connection_of_an_instance_that_left(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        await conn.invoke(agent.endpoint(), message("echo"), 2)
        assert conn.held() == {agent.name: CAPABILITY}
        await conn.forget(agent.name)
        await wait_until(lambda: agent.server.connection_count == 0, 3)
        assert conn.held() == {}
        assert counters(conn)["reclaimed"] == 1


async def test_a_refused_connect_backs_off_instead_of_hammering_the_agent() -> None:
    port = free_port()
    ep = endpoint(f"127.0.0.1:{port}")
    async with WebSocketConnector() as conn:
        start = time.monotonic()
        with pytest.raises(TransportError) as refused:
            await conn.invoke(ep, message("echo"), 5)
        assert refused.value.retryable
        assert "cannot reach agent" in refused.value.message
        with pytest.raises(TransportError) as waiting:
            await conn.invoke(ep, message("echo"), 30)
        assert waiting.value.retryable
        assert "next connect attempt in" in waiting.value.message
        assert time.monotonic() - start < 5  # failed fast, far from the 30 s deadline
        assert counters(conn)["failed"] == 1  # the second call did not knock
        async with Agent(listen=f"127.0.0.1:{port}"):  # the agent comes up; the backoff ends
            await asyncio.sleep(0.15)
            reply = await conn.invoke(ep, message("echo"), 5)
            assert reply.status == "ok"
        assert counters(conn)["reconnected"] == 0  # a first connection, not a re-established one


# -- the SDK server closing ----------------------------------------------------------------------


async def test_a_graceful_close_finishes_requests_in_flight_and_refuses_new_ones() -> None:
    agent = Agent()
    await agent.server.start()
    async with WebSocketConnector() as conn:
        ep = agent.endpoint()
        slow = asyncio.create_task(
            conn.invoke(ep, message("echo", {"sleep": 0.5}, request_id="slow"), 5)
        )
        await wait_until(lambda: len(agent.seen) == 1, 5)
        closing = asyncio.create_task(agent.server.close(grace_s=5))
        await asyncio.sleep(0.1)
        with pytest.raises(AgentError) as refused:
            await conn.invoke(ep, message("echo", request_id="new"), 5)
        assert refused.value.retryable
        assert "shutting down" in refused.value.message
        reply = await slow
        assert reply.result is not None
        assert reply.result["request_id"] == "slow"
        await closing
        assert agent.server.connection_count == 0
        with pytest.raises(TransportError) as gone:
            await conn.invoke(ep, message("echo", request_id="later"), 5)
        assert gone.value.retryable
        assert counters(conn)["failed"] == 1  # the refused connect; the 1001 close was clean


async def test_past_its_cap_a_connection_answers_overloaded(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ws_server, "MAX_TASKS_PER_CONNECTION", 2)
    async with WebSocketConnector() as conn:
        ep = agent.endpoint()
        calls = [
            asyncio.create_task(
                conn.invoke(ep, message("echo", {"sleep": 0.3}, request_id=f"r-{i}"), 5)
            )
            for i in range(3)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, AgentError)]
    assert len(refused) == 1
    assert refused[0].retryable
    assert refused[0].fault is not None
    assert refused[0].fault.type == "overloaded"


async def test_replies_leave_without_nagle_delay(agent: Agent) -> None:
    async with WebSocketConnector() as conn:
        await conn.invoke(agent.endpoint(), message("echo"), 2)
        (ws,) = agent.server._connections  # the server side of the connection
        sock = ws.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# -- an agent in its own process, killed mid-request ----------------------------------------------

AGENT_PROCESS = """
import asyncio, sys
from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.servers.websocket import WebSocketAgentServer

async def main(port: int) -> None:
    runtime = AgentRuntime("ws-cap", protocol="websocket", instance_id="killed")

    @runtime.operation("echo")
    async def echo(payload, ctx):
        await asyncio.sleep(float(payload.get("sleep", 0)))
        return {"request_id": ctx.request_id}

    server = WebSocketAgentServer(
        runtime.dispatch, listen=f"127.0.0.1:{port}", advertise=f"127.0.0.1:{port}",
        instance_id="killed", max_body_bytes=1 << 20,
    )
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1])))
"""


async def start_agent_process(tmp_path: Path, port: int, run: int) -> Any:
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PROCESS)
    log = tmp_path / f"agent-{run}.log"
    proc = spawn([sys.executable, str(script), str(port)], {}, log)
    await wait_until(lambda: "ready" in proc.output() or proc.popen.poll() is not None, 20)
    assert proc.popen.poll() is None, proc.output()
    return proc


async def test_a_killed_agent_fails_requests_in_flight_at_once_and_a_restart_reconnects(
    tmp_path: Path,
) -> None:
    port = free_port()
    proc = await start_agent_process(tmp_path, port, 1)
    ep = endpoint(f"127.0.0.1:{port}", name="killed")
    async with WebSocketConnector() as conn:
        assert (await conn.invoke(ep, message("echo", request_id="warm"), 5)).status == "ok"
        in_flight = [
            asyncio.create_task(
                conn.invoke(ep, message("echo", {"sleep": 120}, request_id=f"r-{i}"), 60)
            )
            for i in range(5)
        ]
        await asyncio.sleep(0.3)  # all five are running in the agent
        killed_at = time.monotonic()
        proc.kill()
        results = await asyncio.gather(*in_flight, return_exceptions=True)
        assert time.monotonic() - killed_at < 5  # not at their 60 s deadline
        for result in results:
            assert isinstance(result, TransportError), result
            assert result.retryable
            assert "broke" in result.message
        assert conn.waiting() == 0
        assert counters(conn)["failed"] == 1

        proc.popen.wait(5)
        proc = await start_agent_process(tmp_path, port, 2)
        reply = await conn.invoke(ep, message("echo", request_id="after"), 5)
        assert reply.result == {"request_id": "after"}
        stats = counters(conn)
        assert (stats["opened"], stats["reconnected"], stats["failed"]) == (1, 1, 1)


async def test_an_agent_that_stops_answering_pings_is_dropped_before_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No FIN, no RST: a frozen (or unplugged) agent is found out by its missing pongs."""
    for name, value in [
        ("PING_INTERVAL_S", 0.2),
        ("PING_TIMEOUT_S", 0.2),
        ("CLOSE_TIMEOUT_S", 0.2),
    ]:
        monkeypatch.setattr(ws_connector, name, value)
    port = free_port()
    proc = await start_agent_process(tmp_path, port, 1)
    ep = endpoint(f"127.0.0.1:{port}", name="frozen")
    async with WebSocketConnector() as conn:
        assert (await conn.invoke(ep, message("echo", request_id="warm"), 5)).status == "ok"
        proc.kill(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(ep, message("echo", request_id="frozen"), 10)
        assert time.monotonic() - start < 3
        assert err.value.retryable
        assert "broke" in err.value.message
        assert counters(conn)["failed"] == 1
        proc.kill(signal.SIGCONT)
        reply = await conn.invoke(ep, message("echo", request_id="thawed"), 5)
        assert reply.result == {"request_id": "thawed"}
        assert counters(conn)["reconnected"] == 1


# -- hand-written agents: frames exactly as a misbehaving agent sends them ------------------------

Respond = Callable[[ServerConnection, dict[str, Any]], Awaitable[None]]


class RawAgent:
    """A bare websockets server whose frames are written by the test."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.accepted = 0
        self._server: Server | None = None
        self.port = 0

    async def __aenter__(self) -> RawAgent:
        self._server = await serve(self._serve, "127.0.0.1", 0, compression=None)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def endpoint(self, max_message_bytes: int | None = None) -> Endpoint:
        return endpoint(f"127.0.0.1:{self.port}", max_message_bytes, name=f"raw-{self.port}")

    async def _serve(self, ws: ServerConnection) -> None:
        self.accepted += 1
        tasks: set[asyncio.Task[None]] = set()
        try:
            async for data in ws:
                task = asyncio.create_task(self.respond(ws, json.loads(data)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except ConnectionClosed:
            pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def reply(request_id: str, status: int = 200, body: Any = None) -> str:
    return json.dumps({"type": "reply", "request_id": request_id, "status": status, "body": body})


async def test_frames_reach_cannot_use_are_dropped_and_the_right_reply_still_arrives() -> None:
    async def respond(ws: ServerConnection, frame: dict[str, Any]) -> None:
        rid = frame["request_id"]
        await ws.send("this is not JSON")
        await ws.send(b"\x00\xffbinary garbage")
        await ws.send(b"\xff\xfe not UTF-8", text=True)  # a text frame websockets would refuse
        await ws.send("[1, 2, 3]")
        await ws.send(json.dumps({"type": "progress", "request_id": rid, "done": 0.5}))
        await ws.send(reply("req-nobody-waits-for", 200, {"stray": True}))
        await ws.send(reply(rid, 200, {"ok": rid}))

    async with RawAgent(respond) as raw, WebSocketConnector() as conn:
        for i in range(3):
            got = await conn.invoke(raw.endpoint(), message("op", request_id=f"r-{i}"), 3)
            assert got.result == {"ok": f"r-{i}"}
        assert raw.accepted == 1
        assert counters(conn)["failed"] == 0


async def test_a_broken_reply_fails_its_request_alone_and_at_once() -> None:
    async def respond(ws: ServerConnection, frame: dict[str, Any]) -> None:
        rid = frame["request_id"]
        if rid == "nan":
            await ws.send('{"type":"reply","request_id":"nan","status":200,"body":{"x":NaN}}')
        elif rid == "text-status":
            await ws.send(reply(rid, "200", {"ok": True}))  # type: ignore[arg-type]
        elif rid == "truncated":
            await ws.send('{"type":"reply","request_id":"truncated","status":200,"body":{"x":')
        elif rid == "no-type":
            await ws.send(json.dumps({"request_id": rid, "status": 200, "body": {}}))
        elif rid == "deep":
            await ws.send(reply(rid, 200, {"d": json.loads("[" * 100 + "]" * 100)}))
        else:
            await asyncio.sleep(0.2)  # answered after the broken ones
            await ws.send(reply(rid, 200, {"ok": rid}))

    async with RawAgent(respond) as raw, WebSocketConnector() as conn:
        ep = raw.endpoint()
        broken = ["nan", "text-status", "truncated", "no-type", "deep"]
        start = time.monotonic()
        results = await asyncio.gather(
            *(conn.invoke(ep, message("op", request_id=rid), 5) for rid in [*broken, "fine"]),
            return_exceptions=True,
        )
        assert time.monotonic() - start < 2  # none waited for its deadline
        for rid, result in zip(broken, results, strict=False):
            assert isinstance(result, AgentError), (rid, result)
            assert not result.retryable, rid
        assert "not standard JSON" in str(results[0])
        assert "not an HTTP-style integer" in str(results[1])
        assert "not UTF-8 JSON" in str(results[2])
        assert "nested more than 64 levels" in str(results[4])
        fine = results[-1]
        assert not isinstance(fine, BaseException)
        assert fine.result == {"ok": "fine"}
        assert raw.accepted == 1
        assert conn.waiting() == 0


async def test_a_reply_with_another_value_than_an_object_is_wrapped() -> None:
    async def respond(ws: ServerConnection, frame: dict[str, Any]) -> None:
        await ws.send(reply(frame["request_id"], 200, [1, 2]))

    async with RawAgent(respond) as raw, WebSocketConnector() as conn:
        assert (await conn.invoke(raw.endpoint(), message("op"), 3)).result == {"value": [1, 2]}


async def test_a_frame_past_the_frame_limit_ends_the_connection_and_the_next_call_reconnects() -> (
    None
):
    async def respond(ws: ServerConnection, frame: dict[str, Any]) -> None:
        rid = frame["request_id"]
        if rid == "huge":
            await ws.send(reply(rid, 200, {"pad": "x" * (6 * 4096 + 70_000)}))
        elif rid == "waiting":
            await asyncio.sleep(30)
        else:
            await ws.send(reply(rid, 200, {"ok": True}))

    async with RawAgent(respond) as raw, WebSocketConnector() as conn:
        ep = raw.endpoint(max_message_bytes=4096)
        other = asyncio.create_task(conn.invoke(ep, message("op", request_id="waiting"), 10))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(ep, message("op", request_id="huge"), 10)
        assert "close 1009" in err.value.message
        with pytest.raises(TransportError):
            await other
        assert time.monotonic() - start < 2
        assert (await conn.invoke(ep, message("op", request_id="next"), 5)).result == {"ok": True}
        stats = counters(conn)
        assert (stats["reconnected"], stats["failed"]) == (1, 1)
        assert raw.accepted == 2


# -- raw clients: frames the SDK server must survive ----------------------------------------------


async def exchange(ws: ClientConnection, frame: str | bytes, timeout_s: float = 2.0) -> Any:
    await ws.send(frame)
    async with asyncio.timeout(timeout_s):
        return json.loads(await ws.recv())


def request(rid: str, operation: str = "echo", **fields: Any) -> str:
    frame = {"type": "request", "request_id": rid, "operation": operation, "payload": {}}
    frame.update(fields)
    return json.dumps(frame)


async def test_the_server_answers_what_it_can_and_drops_what_names_no_request() -> None:
    async with (
        Agent(max_message_bytes=2048) as agent,
        connect(f"ws://127.0.0.1:{agent.server.port}/reach", compression=None) as ws,
    ):
        await ws.send("not JSON and no id")
        await ws.send("[1, 2]")
        await ws.send(json.dumps({"type": "cancel", "request_id": "x"}))  # another type
        bad = await exchange(ws, '{"type": "request", "request_id": "cut", "operation": ')
        assert (bad["request_id"], bad["status"]) == ("cut", 400)
        assert bad["body"]["error"]["type"] == "invalid_request"
        no_op = await exchange(ws, request("no-op", operation=""))
        assert no_op["status"] == 400
        bad_headers = await exchange(ws, request("h", headers={"x-reach-attempt": 2}))
        assert bad_headers["status"] == 400
        bad_payload = await exchange(ws, request("p", payload=[1]))
        assert bad_payload["status"] == 400
        too_big = await exchange(ws, request("big", payload={"pad": "x" * 3000}))
        assert (too_big["status"], too_big["body"]["error"]["type"]) == (413, "payload_too_large")
        unknown = await exchange(ws, request("u", operation="nope"))
        assert unknown["status"] == 404
        # A request without headers is still deduplicated by the frame's request_id.
        ok = await exchange(ws, request("plain", payload={"a": 1}).encode())  # binary frame
        assert ok == {
            "type": "reply",
            "request_id": "plain",
            "status": 200,
            "body": {"got": {"a": 1}, "request_id": "plain"},
        }
        again = await exchange(ws, request("plain", payload={"a": 1}))
        assert again == ok
        assert agent.runtime.executed == 1
        assert agent.server.accepted == 1


async def test_the_server_closing_refuses_new_connections_while_old_requests_finish() -> None:
    agent = Agent()
    await agent.server.start()
    port = agent.server.port
    async with WebSocketConnector() as conn:
        slow = asyncio.create_task(
            conn.invoke(agent.endpoint(), message("echo", {"sleep": 0.5}, request_id="slow"), 5)
        )
        await wait_until(lambda: len(agent.seen) == 1, 5)
        closing = asyncio.create_task(agent.server.close(grace_s=5))
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionRefusedError):
            async with connect(f"ws://127.0.0.1:{port}/reach", open_timeout=1):
                pass
        assert not slow.done()
        assert (await slow).status == "ok"
        await closing
    assert agent.server.accepted == 1
