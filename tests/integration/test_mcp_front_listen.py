"""`GET /mcp` on the MCP front, against a real gateway on the Temporal dev server: the `mcp`
package's client (session-based) hears `notifications/tools/list_changed` when an MCP server
registered by URL adds tools, and again when it leaves; the 2026-07-28 generation has no GET
stream (405) but `subscriptions/listen`, which the client's `listen` hears the same on; a
caller holds at most 64 streams; a stream ends when the gateway stops (a listen stream with
its request's result)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from gateway_api.mcp_front import MAX_STREAMS_PER_CALLER
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_connector_mcp import registered
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration

SSE = {"Accept": "text/event-stream"}
SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"
LISTEN_HEADERS = {
    "MCP-Protocol-Version": "2026-07-28",
    "Mcp-Method": "subscriptions/listen",
    "Accept": "application/json, text/event-stream",
}


def listen_request(key: str | int, notifications: Any) -> dict[str, Any]:
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    params = {"notifications": notifications, "_meta": meta}
    return {"jsonrpc": "2.0", "id": key, "method": "subscriptions/listen", "params": params}


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[McpServerProcess]:
    running = McpServerProcess(tmp_path_factory.mktemp("mcp"), "session").start()
    try:
        yield await running.ready()
    finally:
        running.stop()


async def initialize(http: httpx.AsyncClient, url: str) -> tuple[str, dict[str, Any]]:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t"},
        },
    }
    r = await http.post(url, json=body, headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 200, r.text
    return r.headers["mcp-session-id"], r.json()["result"]


async def test_a_session_client_hears_that_its_tools_changed(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    server: McpServerProcess,
    capability: str,
) -> None:
    heard: list[Any] = []

    async def handler(message: Any) -> None:
        heard.append(message)

    def changes() -> int:
        return sum(isinstance(m, mcp_types.ToolListChangedNotification) for m in heard)

    url = f"{gateway.url}/mcp"
    session, result = await initialize(http, url)
    assert result["capabilities"]["tools"] == {"listChanged": True}
    async with (
        httpx2.AsyncClient(trust_env=False) as client_http,
        Client(
            streamable_http_client(url, http_client=client_http),
            mode="legacy",
            message_handler=handler,
        ) as client,
        http.stream("GET", url, headers={**SSE, "Mcp-Session-Id": session}) as stream,
    ):
        assert f"{capability}.echo" not in {t.name for t in (await client.list_tools()).tools}
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith(":")  # open: what it lists now is its baseline
        async with registered(http, gateway, server, capability):
            async with asyncio.timeout(20):
                async for line in lines:
                    if line.startswith("data:"):
                        assert "notifications/tools/list_changed" in line
                        break
            assert f"{capability}.echo" in {t.name for t in (await client.list_tools()).tools}
        # It left: the mcp client's own GET stream (open since well before) hears that.
        await wait_until(lambda: changes() >= 1, 20)
        assert f"{capability}.echo" not in {t.name for t in (await client.list_tools()).tools}


async def test_a_2026_client_hears_its_tools_changed_on_subscriptions_listen(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    server: McpServerProcess,
    capability: str,
) -> None:
    url = f"{gateway.url}/mcp"
    async with (
        httpx2.AsyncClient(trust_env=False) as client_http,
        Client(streamable_http_client(url, http_client=client_http)) as client,
    ):
        tools = client.server_capabilities.tools
        assert tools is not None
        assert tools.list_changed is True
        async with client.listen(tools_list_changed=True, prompts_list_changed=True) as sub:
            assert sub.honored.tools_list_changed is True
            assert not sub.honored.prompts_list_changed  # Reach has no prompts
            events = aiter(sub)
            async with registered(http, gateway, server, capability):
                async with asyncio.timeout(20):
                    await anext(events)
                names = {t.name for t in (await client.list_tools()).tools}
                assert f"{capability}.echo" in names


async def test_subscriptions_listen_answers_as_its_spec_says(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    url = f"{gateway.url}/mcp"
    bad = await http.post(url, json=listen_request("s", 3), headers=LISTEN_HEADERS)
    assert bad.json()["error"]["code"] == -32602
    plain = {**LISTEN_HEADERS, "Accept": "application/json"}
    refused = await http.post(url, json=listen_request("s", {}), headers=plain)
    assert refused.status_code == 406
    asked = listen_request("sub-1", {"toolsListChanged": True, "promptsListChanged": True})
    async with http.stream("POST", url, json=asked, headers=LISTEN_HEADERS) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        async with asyncio.timeout(10):
            first = await anext(line async for line in stream.aiter_lines() if line[:5] == "data:")
    ack = json.loads(first[5:])
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"]["notifications"] == {"toolsListChanged": True}  # no prompts here
    assert ack["params"]["_meta"] == {SUBSCRIPTION: "sub-1"}


async def test_get_answers_as_each_generation_says(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    url = f"{gateway.url}/mcp"
    modern = await http.get(url, headers={**SSE, "MCP-Protocol-Version": "2026-07-28"})
    assert modern.status_code == 405  # 2026-07-28 has no GET stream
    assert modern.headers["allow"] == "POST"
    plain = await http.get(url, headers={"Accept": "application/json"})
    assert plain.status_code == 406
    assert "text/event-stream" in plain.json()["error"]["message"]
    foreign = await http.get(url, headers={**SSE, "Mcp-Session-Id": "not-one-of-reach-s"})
    assert foreign.status_code == 404
    session, _ = await initialize(http, url)
    async with http.stream("GET", url, headers={**SSE, "Mcp-Session-Id": session}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
    assert (await http.put(url)).status_code == 405


async def test_a_caller_holds_at_most_so_many_streams(gateway: GatewayProcess) -> None:
    url = f"{gateway.url}/mcp"
    limits = httpx.Limits(max_connections=MAX_STREAMS_PER_CALLER + 4)
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as http,
        contextlib.AsyncExitStack() as streams,
    ):

        async def stream() -> httpx.Response:
            response = await streams.enter_async_context(http.stream("GET", url, headers=SSE))
            assert response.status_code == 200
            return response

        held = await asyncio.gather(*(stream() for _ in range(MAX_STREAMS_PER_CALLER)))
        refused = await http.get(url, headers=SSE)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["data"]["type"] == "rate_limited"
        assert f"holds {MAX_STREAMS_PER_CALLER} open GET /mcp streams" in error["message"]
        await held[0].aclose()  # one let go of: room for one more

        async def room() -> bool:
            async with http.stream("GET", url, headers=SSE) as again:
                return again.status_code == 200

        await wait_until(room, timeout_s=10)


async def test_a_stream_ends_when_the_gateway_stops(temporal_server: str, tmp_path: Path) -> None:
    gateway = GatewayProcess(new_stack(temporal_server, tmp_path))
    try:
        await gateway.ready()
        async with (
            httpx.AsyncClient(trust_env=False, timeout=60) as http,
            http.stream("GET", f"{gateway.url}/mcp", headers=SSE) as stream,
            http.stream(
                "POST",
                f"{gateway.url}/mcp",
                json=listen_request(7, {"toolsListChanged": True}),
                headers=LISTEN_HEADERS,
            ) as listening,
        ):
            assert stream.status_code == 200
            assert listening.status_code == 200
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith(":")
            stopping = time.monotonic()
            os.killpg(gateway.proc.popen.pid, signal.SIGTERM)
            rest = [line async for line in lines]
            said = [line async for line in listening.aiter_lines() if line.startswith("data:")]
        assert time.monotonic() - stopping < 10, rest  # not uvicorn's wait for the stream
        # A listen stream ends with its request's result (a graceful end, not a lost stream).
        assert json.loads(said[-1][5:]) == {
            "jsonrpc": "2.0",
            "id": 7,
            "result": {"_meta": {SUBSCRIPTION: 7}, "resultType": "complete"},
        }
        await asyncio.to_thread(gateway.proc.popen.wait, 30)
    finally:
        gateway.proc.stop()


async def test_streams_opened_all_at_once_are_bounded_too(
    temporal_server: str, tmp_path: Path, redis_prefix: str
) -> None:
    """The bound is taken before the caller's first list is read (which waits on a Redis
    registry when the catalog's cache is stale), so streams asked for at the same moment cannot
    all pass it."""
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    async with GatewayProcess(stack) as gateway:
        await _opened_at_once(f"{gateway.url}/mcp")


async def _opened_at_once(url: str) -> None:
    many = 4 * MAX_STREAMS_PER_CALLER
    limits = httpx.Limits(max_connections=many + 4)
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as http,
        contextlib.AsyncExitStack() as streams,
    ):

        async def stream(i: int) -> int:
            if i % 2:
                body = json.dumps(listen_request(i, {"toolsListChanged": True}))
                opened = http.stream("POST", url, content=body, headers=LISTEN_HEADERS)
            else:
                opened = http.stream("GET", url, headers=SSE)
            response = await streams.enter_async_context(opened)
            return response.status_code

        for _ in range(3):  # each after the catalog's cache went stale
            await asyncio.sleep(2.1)
            codes = await asyncio.gather(*(stream(i) for i in range(many)))
            assert codes.count(200) <= MAX_STREAMS_PER_CALLER, codes.count(200)
            assert set(codes) <= {200, 429}
            await streams.aclose()
