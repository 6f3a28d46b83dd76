"""The MCP connector against real MCP servers (the `mcp` package's, each in its own process):
both protocol generations, every kind of answer, sessions forgotten, deadlines, a server killed
mid-call; and a real gateway invoking their tools durably."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_proto import wire
from connectors.mcp import McpConnector
from reach.errors import AgentError, DeadlineExceeded, InvalidRequest
from reach.invocation import Endpoint
from reach.registry.models import Discovery
from tests.conftest import new_stack
from tests.helpers import (
    TRACEPARENT,
    CallbackReceiver,
    GatewayProcess,
    Worker,
    free_port,
    message,
    rid,
    spawn,
    wait_until,
)
from tests.mcp_servers import McpServerProcess, install_everything, node_binary

pytestmark = pytest.mark.integration

MODES = ("stateless", "session")
VERSIONS = {"stateless": "2026-07-28", "session": "2025-11-25"}


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    """A stateless (2026-07-28) and a session-based (2025-11-25) server for the module."""
    tmp = tmp_path_factory.mktemp("mcp")
    running = {mode: McpServerProcess(tmp, mode).start() for mode in MODES}
    try:
        await asyncio.gather(*(s.ready() for s in running.values()))
        yield running
    finally:
        for server in running.values():
            server.stop()


@pytest.fixture(scope="module")
async def connector() -> AsyncIterator[McpConnector]:
    async with McpConnector() as conn:
        yield conn


def endpoint(server: McpServerProcess, **fields: Any) -> Endpoint:
    return Endpoint(
        instance_id=f"mcp-{server.port}",
        capability="tools",
        protocol="mcp",
        address=server.url,
        **fields,
    )


def test_the_address_is_the_endpoint_url() -> None:
    assert McpConnector.check_address("HTTP://Tools.Example:8080/mcp") == (
        "http://tools.example:8080/mcp"
    )
    assert McpConnector.check_address("http://tools.example/mcp/") == "http://tools.example/mcp/"
    assert McpConnector.check_address("http://tools.example/") == "http://tools.example"
    assert McpConnector.address_host_port("https://tools.example/mcp") == ("tools.example", 443)
    for bad in ("tools.example:8080", "ftp://tools.example/mcp", "http://u@tools.example/mcp"):
        with pytest.raises(InvalidRequest):
            McpConnector.check_address(bad)


@pytest.mark.parametrize("mode", MODES)
async def test_tools_are_discovered_as_operations(
    servers: dict[str, McpServerProcess], connector: McpConnector, mode: str
) -> None:
    found = await connector.discover(servers[mode].url)
    ops = {op.name: op for op in found.operations}
    assert set(ops) == {
        *("echo", "lookup", "put", "count", "slow", "fail", "long_task"),
        *("ask_model", "ask_user", "chatty", "grow", "grow_quietly"),
    }
    # Annotations decide: readOnlyHint or idempotentHint is idempotent, nothing else is.
    assert {name for name, op in ops.items() if op.idempotent} == {"lookup", "put"}
    assert ops["echo"].description == "Say the text back."
    assert ops["echo"].input_schema is not None
    assert ops["echo"].input_schema["properties"]["text"]["type"] == "string"
    assert found.details["protocol_version"] == VERSIONS[mode]
    assert found.details["sessions"] is (mode == "session")
    assert found.details["server"] == {"name": f"reach-test-{mode}", "version": "1.2.3"}
    again = await connector.discover(servers[mode].url, found)
    assert again.version == found.version  # the same list, the same version
    Discovery.model_validate(found.model_dump())  # within the model's bounds


@pytest.mark.parametrize("mode", MODES)
async def test_answers_become_results_or_agent_errors(
    servers: dict[str, McpServerProcess], connector: McpConnector, mode: str
) -> None:
    server = servers[mode]
    ep = endpoint(server)
    sent = message("lookup", {"key": "abc"})
    reply = await connector.invoke(ep, sent, 5)
    assert reply.status == "ok"
    assert reply.result == {"key": "abc", "value": "ABC"}  # structuredContent as it is
    echoed = await connector.invoke(ep, message("echo", {"text": "hi"}), 5)
    assert echoed.result == {"content": [{"type": "text", "text": "hi"}], "text": "hi"}
    with pytest.raises(AgentError) as failed:
        await connector.invoke(ep, message("fail", {"reason": "no stock"}), 5)
    assert not failed.value.retryable
    assert failed.value.fault is not None
    assert failed.value.fault.type == "tool_error"
    assert "refused: no stock" in failed.value.fault.message
    with pytest.raises(AgentError) as unknown:
        await connector.invoke(ep, message("no-such-tool", {}), 5)
    assert not unknown.value.retryable
    # Reach's metadata travels in _meta, under the names every protocol uses.
    call = next(
        s
        for s in (await server.seen())["seen"]
        if s["method"] == "tools/call"
        and (s["meta"] or {}).get(wire.REQUEST_ID) == sent.header.request_id
    )
    meta = call["meta"]
    assert meta[wire.CALLER] == "tester"
    assert meta[wire.ATTEMPT] == 2
    assert meta[wire.DEADLINE_MS] == sent.header.deadline_ms
    assert meta[wire.IDEMPOTENCY_KEY] == "key-1"
    assert meta[wire.TRACEPARENT] == TRACEPARENT
    assert call["version"] == VERSIONS[mode]
    assert (call["session"] is not None) is (mode == "session")


@pytest.mark.parametrize("mode", MODES)
async def test_a_slow_tool_past_its_deadline_is_cancelled(
    servers: dict[str, McpServerProcess], connector: McpConnector, mode: str
) -> None:
    server = servers[mode]
    sent = message("slow", {"seconds": 10})
    with pytest.raises(DeadlineExceeded):
        await connector.invoke(endpoint(server), sent, 0.5)

    async def cancelled() -> bool:
        seen = await server.seen()
        if mode == "session":  # told by notifications/cancelled naming the request
            ids = [
                s["id"]
                for s in seen["seen"]
                if (s["meta"] or {}).get(wire.REQUEST_ID) == sent.header.request_id
            ]
            told = [s for s in seen["seen"] if s["method"] == "notifications/cancelled"]
            if not any(t["params"]["requestId"] in ids for t in told):
                return False
        return "slow" in seen["cancelled"]  # the tool itself stopped

    await wait_until(cancelled, 10)


async def test_a_forgotten_session_is_renewed_and_the_call_made_once(
    connector: McpConnector, tmp_path: Path
) -> None:
    server = await McpServerProcess(tmp_path, "session").start().ready()  # its own: restarted
    ep = endpoint(server)
    await connector.invoke(ep, message("count", {"tag": "before"}), 5)
    before = server.count()
    await server.restart()  # the new process knows no session
    reply = await connector.invoke(ep, message("count", {"tag": "after"}), 5)
    assert reply.result == {"calls": before + 1}
    seen = (await server.seen())["seen"]
    assert [s["method"] for s in seen][:3] == [
        "tools/call",
        "initialize",
        "notifications/initialized",
    ]
    assert seen[0]["session"] != seen[3]["session"]  # refused in the old session, run in a new one


async def test_a_worker_without_the_cache_uses_what_discovery_found(
    servers: dict[str, McpServerProcess],
) -> None:
    server = servers["stateless"]

    async def probes() -> int:
        return [s["method"] for s in (await server.seen())["seen"]].count("server/discover")

    before = await probes()
    async with McpConnector() as fresh:
        ep = endpoint(server, details={"protocol_version": "2026-07-28"})
        await fresh.invoke(ep, message("echo", {"text": "x"}), 5)
    assert await probes() == before  # no probe first: discovery said which version
    # A 2025 server without sessions (this one, spoken to as discovery once found it).
    async with McpConnector() as fresh:
        ep = endpoint(server, details={"protocol_version": "2025-11-25"})
        await fresh.invoke(ep, message("echo", {"text": "z"}), 5)
    last = (await server.seen())["seen"][-1]
    assert (last["method"], last["version"], last["session"]) == ("tools/call", "2025-11-25", None)
    # What it said no longer holds (the server went back to 2025): refused, negotiated, resent.
    older = servers["session"]
    async with McpConnector() as fresh:
        ep = endpoint(older, details={"protocol_version": "2026-07-28"})
        reply = await fresh.invoke(ep, message("echo", {"text": "y"}), 5)
    assert reply.result is not None
    assert reply.result["text"] == "y"
    tail = [(s["method"], s["version"]) for s in (await older.seen())["seen"] if s["method"]][-5:]
    assert tail[0] == ("tools/call", "2026-07-28")
    assert tail[-1] == ("tools/call", "2025-11-25")


# -- through a real gateway ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def registered(
    http: httpx.AsyncClient, gateway: GatewayProcess, server: McpServerProcess, capability: str
) -> AsyncIterator[str]:
    """The server registered by its URL as an instance of `capability` (the gateway discovers
    its tools and probes it), removed when the block ends."""
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={"protocol": "mcp", "service_address": server.url, "capability": capability},
    )
    assert r.status_code == 200, r.text
    iid = r.json()["instance_id"]
    try:
        yield iid
    finally:
        with contextlib.suppress(httpx.HTTPError):  # a gateway a test killed removes nothing
            await http.delete(f"{gateway.url}/reach/agents/{iid}")


async def test_invoked_through_a_gateway(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    async with registered(http, gateway, servers["stateless"], capability) as iid:
        shown = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
        assert shown["instances"][0]["details"]["protocol_version"] == "2026-07-28"
        declared = shown["instances"][0]["declared"]
        assert {op for op, d in declared.items() if d["idempotent"]} == {"lookup", "put"}
        url = f"{gateway.url}/reach/invoke"
        r = await http.post(
            url, json={"target": capability, "operation": "lookup", "payload": {"key": "q"}}
        )
        assert r.status_code == 200, r.text
        assert r.json()["result"] == {"key": "q", "value": "Q"}
        assert r.json()["instance_id"] == iid
        r = await http.post(
            url, json={"target": capability, "operation": "fail", "payload": {"reason": "x"}}
        )
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["type"] == "agent_error"
        assert error["agent"]["type"] == "tool_error"
        assert "refused: x" in error["agent"]["message"]


async def test_a_long_call_answered_with_a_task_is_followed(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    servers: dict[str, McpServerProcess],
    capability: str,
) -> None:
    server = servers["stateless"]
    async with registered(http, gateway, server, capability):
        url = f"{gateway.url}/reach/invoke"
        body = {"target": capability, "operation": "long_task", "payload": {"seconds": 0.5}}
        r = await http.post(url, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["result"] == {
            "content": [{"type": "text", "text": "finished"}],
            "text": "finished",
        }
        methods = [s["method"] for s in (await server.seen())["seen"]]
        assert "tasks/get" in methods
        # Past its deadline the task is cancelled (tasks/cancel), and the request is a timeout.
        r = await http.post(url, json={**body, "payload": {"seconds": 60}, "timeout_ms": 1500})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["outcome_unknown"] is True

        async def cancelled() -> bool:
            return any(c.startswith("task ") for c in (await server.seen())["cancelled"])

        await wait_until(cancelled, 10)


async def test_a_server_killed_mid_call_is_an_unknown_outcome_never_run_twice(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    tmp_path: Path,
    capability: str,
) -> None:
    server = await McpServerProcess(tmp_path, "stateless").start().ready()
    try:
        async with registered(http, gateway, server, capability):
            call = asyncio.create_task(
                http.post(
                    f"{gateway.url}/reach/invoke",
                    json={
                        "target": capability,
                        "operation": "count",
                        "payload": {"tag": "once", "sleep_s": 30},
                        "timeout_ms": 15000,
                    },
                )
            )
            await wait_until(lambda: server.count() == 1, 15, every_s=0.02)
            # Killed mid-call, then back at once: a re-delivery would reach it and run it again.
            await server.restart()
            r = await call
        assert r.status_code in (502, 504), r.text
        error = r.json()["error"]
        assert error["outcome_unknown"] is True
        assert server.count() == 1
    finally:
        server.stop()


# -- the reference server from npm -----------------------------------------------------------------


@pytest.fixture(scope="module")
async def everything(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """`@modelcontextprotocol/server-everything` over Streamable HTTP: its endpoint URL."""
    script = install_everything()
    if isinstance(script, str):
        pytest.skip(script)
    port = free_port()
    proc = spawn(
        [node_binary(), str(script), "streamableHttp"],
        {"PORT": str(port)},
        tmp_path_factory.mktemp("everything") / "server.log",
    )
    url = f"http://127.0.0.1:{port}/mcp"

    async def listening() -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"server-everything exited:\n{proc.output()}")
        return "listening on port" in proc.output()

    try:
        await wait_until(listening, 30, every_s=0.05)
        yield url
    finally:
        proc.kill()  # it holds SIGTERM for seconds, and keeps no state worth a clean exit
        proc.popen.wait()


async def test_the_reference_server_from_npm(everything: str) -> None:
    async with McpConnector() as conn:
        found = await conn.discover(everything)
        assert "echo" in {op.name for op in found.operations}
        assert found.details["server"]["name"] == "mcp-servers/everything"
        ep = Endpoint(
            instance_id="everything", capability="ref", protocol="mcp", address=everything
        )
        reply = await conn.invoke(ep, message("echo", {"message": "hello"}), 10)
    assert reply.result is not None
    assert reply.result["text"] == "Echo: hello"


@pytest.mark.slow  # ~20 s: Temporal's wait before another worker takes the request over
async def test_a_gateway_sigkilled_while_following_a_task_never_calls_the_tool_again(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(temporal_server, tmp_path)
    doomed = GatewayProcess(stack, "doomed")  # the door and the worker the call runs in
    survivor = Worker(stack)  # follows the task after the crash, with no cache of the server
    server = McpServerProcess(tmp_path, "stateless").start()
    await asyncio.gather(doomed.ready(), survivor.ready(), server.ready())
    async with registered(http, doomed, server, "mcp-patient"), CallbackReceiver() as receiver:
        request_id = rid()
        r = await http.post(
            f"{doomed.url}/reach/invoke",
            json={
                "request_id": request_id,
                "target": "mcp-patient",
                "operation": "long_task",
                "payload": {"seconds": 3},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def following() -> bool:
            return "tasks/get" in [s["method"] for s in (await server.seen())["seen"]]

        await wait_until(following, 10, every_s=0.05)
        doomed.proc.kill()  # SIGKILL while following the task
        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        _, body = receiver.received[0]
        assert body["status"] == "success", body
        assert body["result"]["text"] == "finished"
    calls = [s for s in (await server.seen())["seen"] if s["method"] == "tools/call"]
    assert len(calls) == 1  # the tool was called once, ever
