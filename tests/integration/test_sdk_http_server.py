"""The SDK's HTTP/1.1 agent server (h11) over raw sockets: framing, smuggling, slow clients."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.servers import http as http_server
from agent_reach_sdk.servers.http import HttpAgentServer
from agent_reach_sdk.wire import Answer, Inbound
from tests.helpers import agent_server

pytestmark = pytest.mark.integration


async def echo(request: Inbound) -> Answer:
    return Answer(200, {"op": request.operation, "body": request.body.decode()})


@pytest.fixture
async def server() -> AsyncIterator[HttpAgentServer]:
    s = agent_server(echo)
    await s.start()
    try:
        yield s
    finally:
        await s.close(0.5)


async def exchange(server: HttpAgentServer, raw: bytes, read_s: float = 2.0) -> bytes:
    """Send `raw`, then read until the server closes or `read_s` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(raw)
    await writer.drain()
    out = b""
    try:
        async with asyncio.timeout(read_s):
            while chunk := await reader.read(65536):
                out += chunk
    except TimeoutError:
        out += b"<still open>"
    writer.close()
    return out


async def test_a_chunked_body_reaches_the_operation(server: HttpAgentServer) -> None:
    raw = (
        b"POST /reach/echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
        b'Connection: close\r\n\r\n5\r\n{"a":\r\n3\r\n 1}\r\n0\r\n\r\n'
    )
    out = await exchange(server, raw)
    assert out.startswith(b"HTTP/1.1 200 ")
    body = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert body == {"op": "echo", "body": '{"a": 1}'}


async def test_pipelined_requests_are_answered_in_order(server: HttpAgentServer) -> None:
    one = b"POST /reach/first HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
    two = (
        b"POST /reach/second HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}"
    )
    out = await exchange(server, one + two)
    assert out.count(b"HTTP/1.1 200 ") == 2
    assert out.index(b'"op":"first"') < out.index(b'"op":"second"')


async def test_a_request_framed_two_ways_is_refused_and_the_connection_closed(
    server: HttpAgentServer,
) -> None:
    """Content-Length with Transfer-Encoding is how request smuggling starts (RFC 9112 6.1)."""
    smuggled = b"POST /reach/smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
    raw = (
        b"POST /reach/echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled
    )
    out = await exchange(server, raw)
    assert out.startswith(b"HTTP/1.1 400 ")
    assert b"Connection: close" in out
    assert b"<still open>" not in out
    assert b"smuggled" not in out  # the bytes after it never ran as a request


async def test_expect_100_continue_is_honoured(server: HttpAgentServer) -> None:
    raw = (
        b"POST /reach/echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n{}"
    )
    out = await exchange(server, raw)
    assert out.startswith(b"HTTP/1.1 100 ")
    assert b"HTTP/1.1 200 " in out


async def test_a_client_trickling_its_head_is_dropped(
    server: HttpAgentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "REQUEST_TIMEOUT_S", 0.3)
    out = await exchange(server, b"POST /reach/echo HTTP/1.1\r\nHost: a\r\n", read_s=3)
    assert out == b""  # closed without an answer, well before read_s


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(
    server: HttpAgentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "IDLE_TIMEOUT_S", 0.3)
    raw = b"POST /reach/echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
    out = await exchange(server, raw, read_s=3)
    assert out.startswith(b"HTTP/1.1 200 ")
    assert b"<still open>" not in out  # answered, then closed once idle


# -- what Reach never sends, through the runtime (issue 25) ---------------------------------------


@pytest.fixture
async def agent() -> AsyncIterator[tuple[HttpAgentServer, list[object]]]:
    runtime = AgentRuntime("cap", instance_id="cap-http")
    ran: list[object] = []
    runtime.operation("echo")(ran.append)
    s = agent_server(runtime.dispatch)
    await s.start()
    try:
        yield s, ran
    finally:
        await s.close(0.5)


def post(body: bytes, **headers: str) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        f"POST /reach/echo HTTP/1.1\r\nHost: a\r\nContent-Length: {len(body)}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode() + body


def answer_of(out: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_a_body_nested_too_deeply_is_a_final_invalid_request_not_a_500(
    agent: tuple[HttpAgentServer, list[object]],
) -> None:
    server, ran = agent
    deep = b"[" * 50_000 + b"]" * 50_000
    status, body = answer_of(await exchange(server, post(deep)))
    assert status == 422
    assert body["error"] == {
        "type": "invalid_request",
        "message": "the payload is nested too deeply (Reach sends at most 64 levels)",
        "retryable": False,
    }
    assert ran == []


async def test_a_body_that_is_not_an_object_does_not_reach_the_handler(
    agent: tuple[HttpAgentServer, list[object]],
) -> None:
    server, ran = agent
    status, body = answer_of(await exchange(server, post(b"[1, 2, 3]")))
    assert status == 422
    assert body["error"] == {
        "type": "invalid_request",
        "message": "the payload must be a JSON object, not an array",
        "retryable": False,
    }
    assert ran == []
    status, _ = answer_of(await exchange(server, post(b'{"ok": true}')))
    assert (status, ran) == (200, [{"ok": True}])


@pytest.mark.parametrize("attempt", ["-3", "0", "1" + "0" * 30])
async def test_an_attempt_header_out_of_range_is_a_400_naming_it(
    agent: tuple[HttpAgentServer, list[object]], attempt: str
) -> None:
    server, ran = agent
    status, body = answer_of(await exchange(server, post(b"{}", **{"X-Reach-Attempt": attempt})))
    assert status == 400
    error = body["error"]
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request"
    assert error["message"].startswith("X-Reach-Attempt is an integer from 1 to 1000000")
    assert ran == []
