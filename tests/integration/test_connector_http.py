"""The HTTP connector against real servers: every outcome becomes a Reply or a typed error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import connectors
from agent_reach_sdk.wire import Answer, Inbound
from connectors import public_context
from connectors.http import HttpConnector
from reach.config import TransportSettings
from reach.errors import AgentError, AgentFault, DeadlineExceeded, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import dumps, json_size
from tests.helpers import (
    TRACEPARENT,
    agent_server,
    count_ca_bundles,
    free_port,
    message,
    path_server,
    wait_until,
)

pytestmark = pytest.mark.integration

SEEN: list[Inbound] = []


def agent_error(status: int, type_: str, text: str) -> Answer:
    return Answer(status, {"error": {"type": type_, "message": text}})


async def handler(request: Inbound) -> Answer:
    SEEN.append(request)
    op = request.operation
    if op == "ok":
        return Answer(200, {"got": json.loads(request.body)})
    if op == "list":
        return Answer(200, [1, 2])  # type: ignore[arg-type]
    if op == "later":
        return Answer(202, {"status": "accepted"})
    if op == "slow":
        await asyncio.sleep(1)
        return Answer(200, {})
    if op == "overloaded":
        return agent_error(503, "agent_error", "busy")
    if op == "big":
        return agent_error(413, "payload_too_large", "no")
    if op == "ran_out":
        return agent_error(504, "timeout", "the operation passed the request's deadline")
    if op == "says_timeout":  # an agent's own word: not Reach's timeout
        return agent_error(500, "timeout", "my database timed out")
    if op == "says_unauthorized":
        return agent_error(422, "unauthorized", "no such user in my records")
    if op == "throttled":
        return agent_error(429, "slow_down", "later")
    if op == "refused":
        return agent_error(400, "bad_input", "q must be a number")
    return agent_error(404, "invalid_request", "unknown op")


def endpoint(port: int, max_message_bytes: int | None = None, name: str = "a1") -> Endpoint:
    return Endpoint(
        instance_id=name,
        capability="cap",
        protocol="http",
        address=f"127.0.0.1:{port}",
        max_message_bytes=max_message_bytes,
    )


@pytest.fixture
async def agent() -> AsyncIterator[Endpoint]:
    server = agent_server(handler)
    await server.start()
    try:
        yield endpoint(server.port)
    finally:
        await server.close()


async def test_http_connector_outcomes(agent: Endpoint) -> None:
    ep = agent
    async with HttpConnector() as conn:
        sent = message("ok")
        reply = await conn.invoke(ep, sent, 2)
        assert reply.status == "ok"
        assert reply.result == {"got": {"q": "x"}}
        h = SEEN[-1].headers
        assert h["x-reach-request-id"] == sent.header.request_id
        assert h["x-reach-caller"] == "tester"
        assert h["x-reach-attempt"] == "2"
        assert h["idempotency-key"] == "key-1"
        assert h["traceparent"] == TRACEPARENT
        assert int(h["x-reach-deadline-ms"]) > time.time() * 1000
        assert (await conn.invoke(ep, message("list"), 2)).result == {"value": [1, 2]}
        assert (await conn.invoke(ep, message("later"), 2)).status == "accepted"
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(ep, message("slow"), 0.2)
        with pytest.raises(AgentError) as busy:
            await conn.invoke(ep, message("overloaded"), 2)
        assert busy.value.retryable
        with pytest.raises(AgentError) as missing:
            await conn.invoke(ep, message("nope"), 2)
        assert not missing.value.retryable
        assert "operation not served" in missing.value.message
        dead = ep.model_copy(update={"address": f"127.0.0.1:{free_port()}"})
        with pytest.raises(TransportError) as refused:
            await conn.invoke(dead, message("ok"), 2)
        assert refused.value.retryable


async def test_the_body_sent_is_the_payload_as_reach_measures_it(agent: Endpoint) -> None:
    payload = {"text": "日本語のテキスト, é, 🙂 " * 2000, "n": [1.5, None, True]}
    async with HttpConnector() as conn:
        await conn.invoke(agent, message("ok", payload), 2)
    assert SEEN[-1].body == dumps(payload)
    assert len(SEEN[-1].body) == json_size(payload)


# -- the agent's words stay inside an agent_error -----------------------------------------------


@pytest.mark.parametrize(
    ("op", "retryable", "fault"),
    [
        ("says_timeout", True, AgentFault(type="timeout", message="my database timed out")),
        ("says_unauthorized", False, AgentFault(type="unauthorized", message="no such user")),
        ("big", False, AgentFault(type="payload_too_large", message="no")),
        ("throttled", True, AgentFault(type="slow_down", message="later")),
        ("refused", False, AgentFault(type="bad_input", message="q must be a number")),
        ("overloaded", True, AgentFault(type="agent_error", message="busy")),
        ("nope", False, AgentFault(type="invalid_request", message="unknown op")),
    ],
)
async def test_an_agents_error_is_an_agent_error_with_its_words_inside(
    agent: Endpoint, op: str, retryable: bool, fault: AgentFault
) -> None:
    async with HttpConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(agent, message(op), 2)
    assert err.value.type == "agent_error"
    assert err.value.retryable is retryable
    got = err.value.fault
    assert got is not None
    assert got.type == fault.type
    assert got.message.startswith(fault.message)
    assert got.status == int(err.value.message.split("answered ")[1][:3])


async def test_http_504_from_the_agent_is_reachs_timeout(agent: Endpoint) -> None:
    async with HttpConnector() as conn:
        with pytest.raises(DeadlineExceeded, match="passed the request's deadline"):
            await conn.invoke(agent, message("ran_out"), 2)


# -- raw agents: bytes exactly as a misbehaving agent sends them ----------------------------------

Respond = Callable[[str, bytes, asyncio.StreamWriter], Awaitable[None]]


class RawAgent:
    """A bare HTTP/1.1 server whose answers are written byte by byte by the test."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.accepted = 0
        self.open = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> RawAgent:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def endpoint(self, max_message_bytes: int | None = None) -> Endpoint:
        return endpoint(self.port, max_message_bytes, name=f"raw-{self.port}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                path = head.split(" ", 2)[1]
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length:")
                )
                body = await reader.readexactly(length)
                await self.respond(path, body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # shut down by __aexit__; ending normally keeps asyncio's stream callback quiet
        finally:
            self.open -= 1
            self._tasks.discard(task)
            writer.close()


def head(status: str, *headers: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode()


async def hang() -> None:
    await asyncio.sleep(3600)


async def ok_json(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
    reply = b'{"ok":true}'
    writer.write(head("200 OK", f"Content-Length: {len(reply)}") + reply)


LIMIT = 4096


async def test_a_declared_length_over_the_limit_fails_before_reading() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(head("200 OK", "Content-Type: application/json", "Content-Length: 5000"))
        await writer.drain()
        await hang()  # the body never comes: only the header can fail the call in time

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        start = time.monotonic()
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(LIMIT), message("op"), 10)
        assert time.monotonic() - start < 2
    assert not err.value.retryable
    assert "5000 bytes" in err.value.message
    assert "max_message_bytes is 4096" in err.value.message


async def test_a_streamed_reply_fails_as_soon_as_it_passes_the_limit() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(head("200 OK", "Transfer-Encoding: chunked"))
        for _ in range(5):  # 5 KiB, and then nothing: the end never comes
            writer.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
            await writer.drain()
        await hang()

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        start = time.monotonic()
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(LIMIT), message("op"), 10)
        assert time.monotonic() - start < 2
    assert not err.value.retryable
    assert "more than 4096 bytes" in err.value.message


async def test_the_configured_limit_applies_when_none_was_negotiated() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        size = int(path.rsplit("/", 1)[1])
        reply = dumps({"pad": "x" * (size - len('{"pad":""}'))})
        writer.write(head("200 OK", f"Content-Length: {len(reply)}") + reply)

    async with RawAgent(respond) as raw:
        async with HttpConnector(TransportSettings(max_message_bytes=LIMIT)) as conn:
            reply = await conn.invoke(raw.endpoint(None), message(str(LIMIT)), 5)
            assert reply.result is not None
            assert json_size(reply.result) == LIMIT  # exactly the limit passes
            with pytest.raises(AgentError, match="4097 bytes"):
                await conn.invoke(raw.endpoint(None), message(str(LIMIT + 1)), 5)
        # The negotiated limit wins over the configured one.
        async with HttpConnector(TransportSettings(max_message_bytes=LIMIT)) as conn:
            reply = await conn.invoke(raw.endpoint(2 * LIMIT), message(str(LIMIT + 1)), 5)
            assert reply.status == "ok"


async def test_an_error_body_is_read_only_as_far_as_it_is_needed() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        text = b'{"error": {"type": "oom", "message": "' + b"m" * (10 << 20)
        writer.write(head("500 Internal Server Error", f"Content-Length: {len(text) + 3}"))
        writer.write(text[: 200 * 1024])  # a start, then nothing more
        await writer.drain()
        await hang()

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        start = time.monotonic()
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(), message("op"), 10)
        assert time.monotonic() - start < 2
    assert err.value.retryable  # a 5xx
    assert err.value.fault is not None
    assert err.value.fault.status == 500
    assert err.value.fault.message.startswith('{"error": {"type": "oom"')
    assert len(err.value.fault.message) <= 1000


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"truncated": ', "application/json"),
        (b"<html>oops</html>", "text/html"),
        (b'{"x": NaN}', "application/json"),
        (b'{"x": 1e999}', "application/json"),
        (b"\xff\xfe", "application/json"),
    ],
)
async def test_a_result_that_is_not_standard_json_is_not_retried(
    body: bytes, content_type: str
) -> None:
    async def respond(path: str, _: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(
            head("200 OK", f"Content-Type: {content_type}", f"Content-Length: {len(body)}") + body
        )

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(), message("op"), 5)
    assert not err.value.retryable
    assert "answered 200" in err.value.message


async def test_a_plain_text_error_body_is_the_agents_message() -> None:
    async def respond(path: str, _: bytes, writer: asyncio.StreamWriter) -> None:
        text = b"upstream exploded\n"
        writer.write(head("502 Bad Gateway", f"Content-Length: {len(text)}") + text)

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(), message("op"), 5)
    assert err.value.retryable
    assert err.value.fault == AgentFault(
        type="agent_error", message="upstream exploded", status=502
    )


async def test_a_request_reach_cannot_encode_is_not_retried() -> None:
    async with RawAgent(ok_json) as raw, HttpConnector() as conn:
        bad_headers: list[dict[str, Any]] = [
            {"caller": "élan"},  # not ASCII
            {"idempotency_key": "a\r\nX-Injected: 1"},  # h11 refuses it: LocalProtocolError
        ]
        for bad in bad_headers:
            with pytest.raises(TransportError) as err:
                await conn.invoke(raw.endpoint(), message("op", None, **bad), 5)
            assert not err.value.retryable, bad
        unparsable = raw.endpoint().model_copy(update={"address": "[::1:80"})
        with pytest.raises(TransportError) as err:
            await conn.invoke(unparsable, message("op"), 5)
        assert not err.value.retryable
        # The connector is still fine for well-formed requests.
        assert (await conn.invoke(raw.endpoint(), message("op"), 5)).result == {"ok": True}


# -- bounded clients ------------------------------------------------------------------------------


async def test_connections_are_kept_alive_between_calls() -> None:
    async with RawAgent(ok_json) as raw, HttpConnector() as conn:
        for _ in range(5):
            await conn.invoke(raw.endpoint(), message("op"), 5)
        assert raw.accepted == 1


async def test_past_max_pools_the_least_recently_used_address_is_closed() -> None:
    settings = TransportSettings(max_pools=2)
    async with contextlib.AsyncExitStack() as stack:
        a, b, c = [await stack.enter_async_context(RawAgent(ok_json)) for _ in range(3)]
        conn = await stack.enter_async_context(HttpConnector(settings))
        await conn.invoke(a.endpoint(), message("op"), 5)
        await conn.invoke(b.endpoint(), message("op"), 5)
        await conn.invoke(a.endpoint(), message("op"), 5)  # b is now the least recently used
        await conn.invoke(c.endpoint(), message("op"), 5)
        await wait_until(lambda: b.open == 0, 5)
        assert (a.open, c.open) == (1, 1)
        await conn.invoke(b.endpoint(), message("op"), 5)  # b comes back, a goes
        await wait_until(lambda: a.open == 0, 5)
        assert (b.open, c.open, b.accepted) == (1, 1, 2)


async def test_an_idle_address_is_reclaimed() -> None:
    settings = TransportSettings(idle_timeout_s=0.3)
    async with RawAgent(ok_json) as raw, HttpConnector(settings) as conn:
        await conn.invoke(raw.endpoint(), message("op"), 5)
        assert raw.open == 1
        await wait_until(lambda: raw.open == 0, 3)
        assert (await conn.invoke(raw.endpoint(), message("op"), 5)).result == {"ok": True}
        assert raw.accepted == 2


async def test_a_client_with_a_request_in_flight_is_never_closed() -> None:
    release = asyncio.Event()

    async def slow(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # busy for as long as the test needs, however slow the machine
        await ok_json(path, body, writer)

    settings = TransportSettings(max_pools=1, idle_timeout_s=0.2)
    async with (
        RawAgent(slow) as busy,
        RawAgent(ok_json) as other,
        HttpConnector(settings) as conn,
    ):
        long_call = asyncio.create_task(conn.invoke(busy.endpoint(), message("op"), 5))
        await wait_until(lambda: busy.open == 1, 5)
        for _ in range(3):  # past max_pools, and past the idle timeout, while busy works
            await conn.invoke(other.endpoint(), message("op"), 5)
            await asyncio.sleep(0.2)
        assert busy.open == 1
        release.set()
        assert (await long_call).result == {"ok": True}
        await wait_until(lambda: busy.open == 0 and other.open == 0, 3)


async def test_a_reply_that_grows_when_re_encoded_is_measured_as_reach_carries_it() -> None:
    """`1e15` is 4 bytes on the wire and 18 once re-encoded: the limit holds for the latter."""

    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        reply = b'{"n":[' + b",".join([b"1e15"] * 600) + b"]}"  # 3 KiB as sent
        writer.write(head("200 OK", f"Content-Length: {len(reply)}") + reply)

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(LIMIT), message("op"), 5)
    assert not err.value.retryable
    assert "the limit is 4096" in err.value.message


async def test_a_reply_nested_deeper_than_reach_carries_is_refused() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        reply = b'{"d":' + b"[" * 100 + b"]" * 100 + b"}"
        writer.write(head("200 OK", f"Content-Length: {len(reply)}") + reply)

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        with pytest.raises(AgentError, match="nested more than 64 levels"):
            await conn.invoke(raw.endpoint(LIMIT), message("op"), 5)


async def test_an_agent_can_withhold_a_retry_but_never_ask_for_one() -> None:
    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        final = path.endswith("final")
        error = {"type": "result_too_large" if final else "bad", "retryable": not final}
        reply = dumps({"error": error})
        status = "500 Internal Server Error" if final else "400 Bad Request"
        writer.write(head(status, f"Content-Length: {len(reply)}") + reply)

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        with pytest.raises(AgentError) as final:
            await conn.invoke(raw.endpoint(LIMIT), message("final"), 5)
        with pytest.raises(AgentError) as asked:
            await conn.invoke(raw.endpoint(LIMIT), message("asks"), 5)
    assert final.value.fault is not None
    assert final.value.fault.type == "result_too_large"
    assert not final.value.retryable  # a 500, but the agent said another attempt can't help
    assert not asked.value.retryable  # a 400 stays final whatever the agent says


async def test_a_reply_trickling_past_the_deadline_is_a_timeout() -> None:
    """httpx's timeout is per read; a byte every 0.3 s never trips it. The call's own does."""

    async def respond(path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(head("200 OK", "Content-Length: 1000"))
        for _ in range(1000):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.3)

    async with RawAgent(respond) as raw, HttpConnector() as conn:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(raw.endpoint(LIMIT), message("op"), 1.0)
        assert time.monotonic() - start < 10  # at the deadline, not after the 300 s trickle


async def test_a_thousand_calls_to_one_instance_all_meet_their_deadline() -> None:
    """Past its 64 connections an instance's callers wait for a slot, not in httpcore's queue
    (whose bookkeeping stalled the event loop for seconds and made 888 of 1000 time out)."""

    async def slow(request: Inbound) -> Answer:
        await asyncio.sleep(0.2)
        return Answer(200, {"ok": True})

    server = agent_server(slow)
    await server.start()
    try:
        async with HttpConnector() as conn:
            ep = endpoint(server.port)
            replies = await asyncio.gather(
                *(conn.invoke(ep, message("op", request_id=f"r{i}"), 15) for i in range(1000)),
                return_exceptions=True,
            )
    finally:
        await server.close()
    failures = [r for r in replies if isinstance(r, BaseException)]
    assert failures == []


@pytest.mark.parametrize("protocol", ["http", "a2a", "mcp"])
async def test_every_client_shares_one_tls_context(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without mTLS, the HTTP, A2A and MCP connectors' clients for every agent share the one
    public TLS context (`connectors._tls.public_context`): building one reads the CA bundle,
    ~15 ms of CPU, which a context per client paid again for each agent and reopened pool."""
    built = count_ca_bundles(monkeypatch)  # one per TLS context built

    async def anything(request: Inbound) -> Answer:
        return Answer(200, {})

    server = path_server(anything)
    await server.start()
    try:
        async with connectors.load(protocol)() as conn:
            for i in range(5):  # each path another agent address, another pool of clients
                base = f"http://127.0.0.1:{server.port}/a{i}"
                ep = Endpoint(
                    instance_id=f"a{i}",
                    capability="cap",
                    protocol=protocol,
                    address=base if protocol != "http" else f"127.0.0.1:{server.port}/a{i}",
                    details={"url": base, "protocol_version": "2025-11-25"},
                )
                # What each answers does not matter here: the client was built to ask.
                with contextlib.suppress(ReachError):
                    await conn.invoke(ep, message("ok", {}), 5)
    finally:
        public_context.cache_clear()
        await server.close()
    assert len(built) == 1, f"{len(built)} TLS contexts built for five agents"
