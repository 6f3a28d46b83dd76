"""What an MCP server says mid-call, against real servers (the `mcp` package's) and a real
gateway on the Temporal dev server: its progress and log messages show in the request's
timeline (and reach an MCP client of Reach's front at the level it asked for), its word that
its tools changed has them discovered again at once, and its requests for a model or a user
(sampling, elicitation) are refused at once instead of holding the call to its deadline; and
an MCP client calling through Reach's front hears that progress."""

from __future__ import annotations

import asyncio
import time
import uuid
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from connectors.mcp import McpConnector
from reach import progress
from reach.errors import AgentError
from reach.invocation import Endpoint
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, Worker, message, rid, wait_until
from tests.integration.test_connector_mcp import everything as everything  # its fixture
from tests.integration.test_connector_mcp import registered
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration

MODES = ("stateless", "session")


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mcp")
    running = {mode: McpServerProcess(tmp, mode).start() for mode in MODES}
    try:
        await asyncio.gather(*(s.ready() for s in running.values()))
        yield running
    finally:
        for server in running.values():
            server.stop()


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """A gateway whose probes are a minute apart (records live five): a tool list found
    changed within seconds was found by the server's word, not by a round."""
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("stack"),
        heartbeat_interval=60.0,
        heartbeat_timeout=300.0,
    )
    async with GatewayProcess(stack) as gw:
        yield gw


async def test_progress_shows_in_the_timeline_while_the_call_runs_and_after(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    for mode in MODES:
        async with registered(http, gateway, servers[mode], f"{capability}-{mode}"):
            request_id = rid()
            body = {
                "target": f"{capability}-{mode}",
                "operation": "slow",
                "payload": {"seconds": 3.0},
                "request_id": request_id,
            }
            call = asyncio.create_task(http.post(f"{gateway.url}/reach/invoke", json=body))
            url = f"{gateway.url}/reach/requests/{request_id}/timeline"

            async def progress_while_running(url: str = url) -> bool:
                r = await http.get(url)
                if r.status_code != 200:
                    return False
                story = r.json()
                kinds = [e["kind"] for e in story["events"]]
                return story["status"] == "running" and "progress" in kinds

            await wait_until(progress_while_running, 15)
            r = await call
            assert r.status_code == 200, r.text
            story = (await http.get(url)).json()
            notes = [e for e in story["events"] if e["kind"] == "progress"]
            # The server reports every 50 ms: the last MAX_NOTES are kept, the rest counted.
            assert len(notes) == progress.MAX_NOTES, mode
            assert notes[0]["detail"]["earlier_not_kept"] > 0
            assert all(n["detail"]["total"] == 3.0 for n in notes)
            assert notes[-1]["detail"]["progress"] > notes[0]["detail"]["progress"]
            assert notes[0]["summary"].startswith("attempt 1 progress ")
            # Placed by time: after the call was sent, before its result.
            kinds = [e["kind"] for e in story["events"]]
            assert kinds.index("sent") < kinds.index("progress")
            assert max(i for i, k in enumerate(kinds) if k == "progress") < kinds.index("result")


async def test_the_reference_servers_progress_shows_in_the_timeline(
    gateway: GatewayProcess, http: httpx.AsyncClient, everything: str, capability: str
) -> None:
    """@modelcontextprotocol/server-everything from npm (session-based): its long-running
    operation reports each of its steps."""
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={"protocol": "mcp", "service_address": everything, "capability": capability},
    )
    assert r.status_code == 200, r.text
    iid = r.json()["instance_id"]
    try:
        request_id = rid()
        body = {
            "target": capability,
            "operation": "trigger-long-running-operation",
            "payload": {"duration": 1.5, "steps": 5},
            "request_id": request_id,
        }
        r = await http.post(f"{gateway.url}/reach/invoke", json=body)
        assert r.status_code == 200, r.text
        url = f"{gateway.url}/reach/requests/{request_id}/timeline"
        notes = [e for e in (await http.get(url)).json()["events"] if e["kind"] == "progress"]
        assert [n["detail"]["progress"] for n in notes] == [1, 2, 3, 4, 5]
        assert {n["detail"]["total"] for n in notes} == {5}
    finally:
        await http.delete(f"{gateway.url}/reach/agents/{iid}")


@pytest.mark.parametrize("client_mode", ["legacy", "auto"])
async def test_an_mcp_client_of_reach_hears_the_progress_of_a_server_behind_it(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
    client_mode: str,
) -> None:
    """MCP both ways: the mcp package's client calls Reach's front, Reach calls an MCP server;
    the server's progress comes back to the client under its own token, increasing."""
    heard: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, said: str | None) -> None:
        heard.append((done, total, said))

    async with (
        registered(http, gateway, servers["session"], capability),
        httpx2.AsyncClient(trust_env=False) as client_http,
        Client(
            streamable_http_client(f"{gateway.url}/mcp", http_client=client_http),
            mode=client_mode,  # type: ignore[arg-type]
        ) as client,
    ):
        result = await client.call_tool(
            f"{capability}.slow", {"seconds": 1.5}, progress_callback=on_progress
        )
    assert not result.is_error, result
    assert heard[0][0] == 0
    assert "is running" in str(heard[0][2])  # Reach's own first word names the request
    relayed = heard[1:]
    assert len(relayed) >= 3, heard
    assert all(total == 1.5 for _, total, _ in relayed)
    values = [done for done, _, _ in heard]
    assert values == sorted(values)
    assert len(set(values)) == len(values)  # increasing, as the spec asks


async def test_log_messages_show_in_the_timeline_redacted_and_bounded(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    """A session-based server sends every level; a 2026-07-28 one only what Reach asked for
    (info and above). A password in a message's data is masked, a long text cut."""
    expected = {
        "session": ["debug", "info", "warning", "error"],
        "stateless": ["info", "warning", "error"],
    }
    for mode in MODES:
        async with registered(http, gateway, servers[mode], f"{capability}-{mode}"):
            request_id = rid()
            body = {
                "target": f"{capability}-{mode}",
                "operation": "chatty",
                "payload": {},
                "request_id": request_id,
            }
            r = await http.post(f"{gateway.url}/reach/invoke", json=body)
            assert r.status_code == 200, r.text
            url = f"{gateway.url}/reach/requests/{request_id}/timeline"
            story = (await http.get(url)).json()
            logged = [e for e in story["events"] if e["kind"] == "log"]
            assert [e["detail"]["level"] for e in logged] == expected[mode], mode
            by_level = {e["detail"]["level"]: e["detail"] for e in logged}
            assert by_level["info"]["data"] == "working"
            assert by_level["info"]["logger"] == "chatty"
            assert by_level["warning"]["data"] == {"user": "ann", "password": "***"}
            assert by_level["error"]["data"] == "x" * progress.MAX_LOG_CHARS
            assert logged[0]["summary"].startswith("attempt 1 log ")
            kinds = [e["kind"] for e in story["events"]]
            assert kinds.index("sent") < kinds.index("log")
            assert max(i for i, k in enumerate(kinds) if k == "log") < kinds.index("result")


@pytest.mark.parametrize("client_mode", ["legacy", "auto"])
async def test_an_mcp_client_of_reach_hears_log_messages_at_the_level_it_asked(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
    client_mode: str,
) -> None:
    """logging/setLevel for a session (kept where every gateway reads it), the request's own
    `_meta` level at 2026-07-28: the server's messages at or above it come back on the call's
    stream, before its result; a client that asked for none hears none."""

    async def heard_with(level: str | None) -> list[Any]:
        heard: list[Any] = []

        async def on_log(params: Any) -> None:
            heard.append(params)

        async with (
            httpx2.AsyncClient(trust_env=False) as client_http,
            Client(
                streamable_http_client(f"{gateway.url}/mcp", http_client=client_http),
                mode=client_mode,  # type: ignore[arg-type]
                logging_callback=on_log,
                log_level=level if client_mode == "auto" else None,  # type: ignore[arg-type]
            ) as client,
        ):
            if level is not None and client_mode == "legacy":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # deprecated from 2026-07-28 on
                    await client.set_logging_level(level)  # type: ignore[arg-type]
            result = await client.call_tool(f"{capability}.chatty", {})
            assert not result.is_error, result
        return heard

    async with registered(http, gateway, servers["session"], capability):
        heard = await heard_with("warning")
        assert [h.level for h in heard] == ["warning", "error"]
        assert heard[0].data == {"user": "ann", "password": "***"}
        assert await heard_with(None) == []


@pytest.mark.slow  # ~40 s here: a gateway and a worker of their own on Redis
async def test_progress_recorded_by_a_queue_worker_shows_in_the_gateways_timeline(
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
) -> None:
    """The call runs in a worker process of its own (queue mode); the notes it keeps in Redis
    are what the gateway's timeline reads."""
    capability = f"queued-{uuid.uuid4().hex[:6]}"
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        extra={"REACH_CAPABILITIES": f'{{"{capability}": {{"mode": "queue"}}}}'},
    )
    gateway = GatewayProcess(stack)
    worker = Worker(stack, "--capability", capability)
    try:
        await asyncio.gather(gateway.ready(), worker.ready())
        async with registered(http, gateway, servers["stateless"], capability):
            request_id = rid()
            body = {
                "target": capability,
                "operation": "slow",
                "payload": {"seconds": 0.5},
                "request_id": request_id,
            }
            r = await http.post(f"{gateway.url}/reach/invoke", json=body)
            assert r.status_code == 200, r.text
            url = f"{gateway.url}/reach/requests/{request_id}/timeline"
            events = (await http.get(url)).json()["events"]
            notes = [e for e in events if e["kind"] == "progress"]
            assert notes, events
            assert all(n["detail"]["total"] == 0.5 for n in notes)
    finally:
        gateway.proc.stop()
        worker.proc.stop()


async def test_a_tool_call_that_reports_nothing_leaves_no_record(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    async with registered(http, gateway, servers["session"], capability):
        request_id = rid()
        body = {
            "target": capability,
            "operation": "echo",
            "payload": {"text": "hi"},
            "request_id": request_id,
        }
        r = await http.post(f"{gateway.url}/reach/invoke", json=body)
        assert r.status_code == 200, r.text
        story = (await http.get(f"{gateway.url}/reach/requests/{request_id}/timeline")).json()
        assert "progress" not in [e["kind"] for e in story["events"]]


async def test_a_changed_tool_list_is_discovered_at_once_on_the_servers_word(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    for mode in MODES:
        cap = f"{capability}-{mode}"
        async with registered(http, gateway, servers[mode], cap):
            shown = (await http.get(f"{gateway.url}/reach/capabilities/{cap}")).json()
            new_tool = f"grown_{mode}"
            assert new_tool not in shown["instances"][0]["declared"]
            started = time.monotonic()
            body = {"target": cap, "operation": "grow", "payload": {"name": new_tool}}
            r = await http.post(f"{gateway.url}/reach/invoke", json=body)
            assert r.status_code == 200, r.text

            async def listed(cap: str = cap, new_tool: str = new_tool) -> bool:
                got = (await http.get(f"{gateway.url}/reach/capabilities/{cap}")).json()
                return new_tool in got["instances"][0]["declared"]

            await wait_until(listed, 20)
            # Probes are a minute apart here: this was the server's word, not a round.
            assert time.monotonic() - started < 30
            r = await http.post(
                f"{gateway.url}/reach/invoke",
                json={"target": cap, "operation": new_tool, "payload": {}},
            )
            assert r.status_code == 200, r.text
            assert r.json()["result"] == {"result": "grown"}


async def test_a_change_said_outside_any_call_is_heard_too(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    """A server says it outside any call: a session-based one on the session's GET stream, a
    2026-07-28 one on its `subscriptions/listen` streams; the gateway holds either since it
    discovered the server."""
    for mode in MODES:
        cap = f"{capability}-{mode}"
        async with registered(http, gateway, servers[mode], cap):
            body = {"target": cap, "operation": "grow_quietly", "payload": {"name": "hushed"}}
            r = await http.post(f"{gateway.url}/reach/invoke", json=body)
            assert r.status_code == 200, r.text

            async def listed(cap: str = cap) -> bool:
                got = (await http.get(f"{gateway.url}/reach/capabilities/{cap}")).json()
                return "hushed" in got["instances"][0]["declared"]

            await wait_until(listed, 20)  # probes are a minute apart here
        methods = [s["method"] for s in (await servers[mode].seen())["seen"]]
        assert methods.count("tools/list") >= 2, mode
        if mode == "stateless":
            assert "subscriptions/listen" in methods


def endpoint(server: McpServerProcess) -> Endpoint:
    return Endpoint(
        capability="cap", instance_id=f"mcp-{server.mode}", address=server.url, protocol="mcp"
    )


@pytest.mark.parametrize("tool", ["ask_model", "ask_user"])
async def test_sampling_and_elicitation_are_refused_at_once(
    servers: dict[str, McpServerProcess], tool: str
) -> None:
    """A session-based server asks on the call's stream and waits for an answer: Reach
    answers -32601 at once (before, the call waited for its whole deadline). A 2026-07-28
    server has no way to ask and fails the call itself."""
    async with McpConnector() as connector:
        for mode in MODES:
            server = servers[mode]
            started = time.monotonic()
            with pytest.raises(AgentError) as caught:
                await connector.invoke(
                    endpoint(server), message(tool, {"question": "why?"}, deadline_s=60), 60
                )
            assert time.monotonic() - started < 30, mode
            assert caught.value.retryable is False
            if mode == "session":
                assert "has no model to sample and no user to ask" in caught.value.message
                seen = (await server.seen())["seen"]
                answers = [s for s in seen if s["method"] is None and s["session"]]
                assert answers, "the refusal went back in the call's session"
