"""The MCP connector's discovery against a hostile server on a loopback socket (a few lines of
HTTP/1.1, since no MCP library answers this way): what one discovery reads is bounded in all,
not per page or per message, so a server registered by URL cannot make every probe of it
read 32 pages of 4 MiB (~450 MB of gateway memory) or parse a stream of notifications until
the probe's timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from connectors import public_context
from connectors.mcp import McpConnector
from connectors.mcp import wire_rules as w
from reach.config import SecuritySettings
from reach.errors import DeadlineExceeded, InvalidRequest
from reach.invocation import Endpoint
from tests.helpers import count_ca_bundles, message

pytestmark = pytest.mark.integration

Answer = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]


def head(status: int, kind: str, length: int | None = None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\n{size}\r\n\r\n".encode()


async def result(writer: asyncio.StreamWriter, message: dict[str, Any], value: Any) -> None:
    data = json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": value}).encode()
    writer.write(head(200, "application/json", len(data)) + data)
    await writer.drain()


class Server:
    """Answers `server/discover` as a 2026-07-28 server, everything else with `answer`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.methods: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                message = json.loads(await reader.readexactly(length)) if length else {}
                self.methods.append(str(message.get("method")))
                if not line.startswith(b"POST") or "id" not in message:
                    writer.write(head(202, "application/json", 0))
                elif message["method"] == "server/discover":
                    await result(writer, message, {"supportedVersions": [w.MODERN]})
                else:
                    await self.answer(message, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(answer: Answer) -> AsyncIterator[tuple[str, Server]]:
    server = Server(answer)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/mcp", server
    finally:
        listening.close()


def connector() -> McpConnector:
    return McpConnector(security=SecuritySettings(allow_networks=["127.0.0.0/8"]))


async def test_a_tool_list_of_many_large_pages_is_refused_past_the_discovery_s_budget() -> None:
    page_bytes = w.MAX_LIST_BYTES - 4096  # each page within the bound of one

    async def pages(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        page = int(message["params"].get("cursor", "0"))
        tool = {"name": f"t{page}", "inputSchema": {"type": "object"}, "x": "A" * page_bytes}
        await result(writer, message, {"tools": [tool], "nextCursor": str(page + 1)})

    async with serving(pages) as (url, server):
        async with connector() as conn:
            with pytest.raises(InvalidRequest, match="in all while saying what it serves"):
                await conn.discover(url)
        listed = server.methods.count("tools/list")
        assert listed == w.MAX_DISCOVERY_BYTES // page_bytes + 1  # not w.MAX_PAGES (32)


async def test_a_stream_of_notifications_stops_a_discovery_at_once() -> None:
    async def flood(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, "text/event-stream"))
        progress = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\n\n'
        chunk = b"%x\r\n%s\r\n" % (len(progress), progress)
        while True:  # never the answer
            writer.write(chunk * 64)
            await writer.drain()

    async with serving(flood) as (url, _):
        started = time.monotonic()
        async with connector() as conn:
            with pytest.raises(InvalidRequest, match="messages that are not the answer"):
                await conn.discover(url)
        # Not the discovery's timeout (10 s) of parsing notifications.
        assert time.monotonic() - started < 5


async def test_a_regular_tool_list_is_read_whole() -> None:
    async def two_pages(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        cursor = message["params"].get("cursor")
        tools = [
            {"name": f"{cursor or 'first'}-{i}", "inputSchema": {"type": "object"}}
            for i in range(3)
        ]
        await result(writer, message, {"tools": tools, **({} if cursor else {"nextCursor": "2"})})

    async with serving(two_pages) as (url, _):
        async with connector() as conn:
            found = await conn.discover(url)
        assert len(found.operations) == 6


async def test_a_server_s_client_builds_no_tls_context_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One TLS context for the connector's every server: building one reads the CA bundle,
    ~15 ms of CPU, paid for each server registered by URL whenever its pool was reopened (each
    probe, past transport.max_pools servers). Counted, not timed: a CPU bound failed on a
    loaded box."""
    built = count_ca_bundles(monkeypatch)  # one per TLS context built

    async def one_tool(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await result(writer, message, {"tools": [{"name": "t", "inputSchema": {"type": "object"}}]})

    try:
        async with serving(one_tool) as (url, _), connector() as conn:
            for i in range(40):
                found = await conn.discover(f"{url}/{i}")  # each path another server, client
                assert found is not None
    finally:
        public_context.cache_clear()
    assert len(built) <= 1, f"{len(built)} TLS contexts built for 40 servers"


async def test_a_tool_call_s_flooded_stream_is_read_at_a_pace() -> None:
    """A server that floods a call's stream with notifications until its deadline: read at
    `PACE_PER_S` past a burst (TCP holds the server back), not parsed as fast as it sends
    (a gateway's core for the call's whole deadline)."""

    async def flood(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, "text/event-stream"))
        progress = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\n\n'
        chunk = b"%x\r\n%s\r\n" % (len(progress), progress)
        while True:  # never the answer
            writer.write(chunk * 64)
            await writer.drain()

    async with serving(flood) as (url, _), connector() as conn:
        ep = Endpoint(instance_id="flood", capability="c", protocol="mcp", address=url)
        started, cpu = time.monotonic(), time.process_time()
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(ep, message("tool", {}), 3.0)
        spent = time.process_time() - cpu
        assert time.monotonic() - started < 6
    # The burst, then PACE_PER_S messages a second: well under a core for the call's 3 s.
    assert spent < 1.0, f"{spent:.2f} s of CPU in a 3 s call"
