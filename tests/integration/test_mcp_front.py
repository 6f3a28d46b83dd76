"""The MCP front (`POST /mcp`) against a real gateway (tokens required, rules) and an SDK agent:
the `mcp` package's own client lists and calls tools through Reach in both protocol
generations; rules hide a denied operation; a call without a token is 401 with the RFC 9728
metadata; malformed JSON-RPC, batches, huge or deep arguments, unknown tools and methods are
each a clear JSON-RPC error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from agent_reach_sdk import AgentRuntime, OperationError
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import ROOT, GatewayProcess, wait_until
from tests.mcp_servers import McpServerProcess

pytestmark = [pytest.mark.integration]

MODERN = "2026-07-28"


class Sum(BaseModel):
    a: int = Field(description="the first term")
    b: int = 0


class Echo(TypedDict):
    text: str


@dataclass
class Mcp:
    gateway: GatewayProcess
    capability: str
    caller: str  # a caller token, allowed all but `secret`
    other: str  # another caller's token: no rule allows it anything
    admin: str = ""

    @property
    def url(self) -> str:
        return f"{self.gateway.url}/mcp"

    @contextlib.asynccontextmanager
    async def client(self, mode: str, token: str | None = None) -> AsyncIterator[Client]:
        """The `mcp` package's client, with a bearer token (the caller's by default)."""
        headers = {"Authorization": f"Bearer {token or self.caller}"}
        async with httpx2.AsyncClient(headers=headers, trust_env=False) as http:
            transport = streamable_http_client(self.url, http_client=http)
            async with Client(transport, mode=mode) as client:  # type: ignore[arg-type]
                yield client


@pytest.fixture(scope="module")
async def mcp(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mcp]:
    tmp = tmp_path_factory.mktemp("mcp-front")
    capability = f"mcp-{uuid.uuid4().hex[:8]}"
    config = yaml.safe_load((ROOT / "reach.yaml").read_text())
    config["reach"]["rules"] = [
        {
            "name": "mcp-client",
            "caller": "mcp-client",
            "target_capability": capability,
            "allowed_operations": ["*"],
            "denied_operations": ["secret"],
        },
        {
            "name": "mcp-client-servers",
            "caller": "mcp-client",
            "target_capability": f"{capability}-srv",
            "allowed_operations": ["*"],
        },
    ]
    (tmp / "reach.yaml").write_text(yaml.safe_dump(config))
    store = FileTokenStore(tmp / "tokens.json")
    tokens = {}
    for name, kind, caps in [
        ("mcp-client", "caller", []),
        ("stranger", "caller", []),
        ("mcp-agent", "agent", [capability]),
        ("ops", "admin", []),
    ]:
        token, record = issue(name, kind, caps)  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    stack = new_stack(temporal_server, tmp, extra={"REACH_CONFIG": str(tmp / "reach.yaml")})
    runtime = AgentRuntime(
        capability,
        protocol="http",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
        token=tokens["mcp-agent"],
    )

    @runtime.operation("add", idempotent=True)
    async def add(payload: Sum) -> dict[str, Any]:
        """Add two integers."""
        return {"sum": payload.a + payload.b}

    @runtime.operation("echo")
    def echo(payload: Echo) -> dict[str, Any]:
        return {"echo": payload["text"]}

    @runtime.operation("picture")
    def picture(payload: dict[str, Any]) -> dict[str, Any]:
        return {"content": [{"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}]}

    @runtime.operation("slow")
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(float(payload.get("s", 0)))
        return {"slept": payload.get("s", 0)}

    @runtime.operation("secret")
    def secret(payload: dict[str, Any]) -> dict[str, Any]:
        return {"secret": 42}

    @runtime.operation("fail")
    def fail(payload: dict[str, Any]) -> dict[str, Any]:
        raise OperationError("the index is not loaded", type="agent_error", status=503)

    async with GatewayProcess(stack) as gateway:
        runtime.reach_url = gateway.url
        async with runtime:
            yield Mcp(gateway, capability, tokens["mcp-client"], tokens["stranger"], tokens["ops"])


def tool_names(tools: Any) -> set[str]:
    return {t.name for t in tools.tools}


@pytest.mark.parametrize("mode", ["legacy", MODERN])
async def test_the_mcp_client_lists_and_calls_tools_through_reach(mcp: Mcp, mode: str) -> None:
    cap = mcp.capability
    async with mcp.client(mode) as client:
        tools = await client.list_tools()
        listed = {f"{cap}.{op}" for op in ("add", "echo", "fail", "picture", "slow")}
        assert tool_names(tools) == listed  # not secret: a rule denies it
        add = next(t for t in tools.tools if t.name == f"{cap}.add")
        assert add.description == "Add two integers."
        assert add.input_schema["properties"]["a"]["description"] == "the first term"
        assert add.input_schema["required"] == ["a"]
        assert add.annotations is not None
        assert add.annotations.idempotent_hint is True

        result = await client.call_tool(f"{cap}.add", {"a": 2, "b": 3})
        assert not result.is_error
        assert result.structured_content == {"sum": 5}
        assert json.loads(result.content[0].text) == {"sum": 5}  # type: ignore[union-attr]
        request_id = (result.meta or {})["reach/requestId"]

        # An operation's name alone reaches it while no other tool has it.
        echoed = await client.call_tool("echo", {"text": "hi"})
        assert echoed.structured_content == {"echo": "hi"}
        # A result that is MCP content blocks is passed on as those blocks.
        image = await client.call_tool(f"{cap}.picture", {})
        assert image.content[0].type == "image"
        assert image.structured_content is None

        failed = await client.call_tool(f"{cap}.fail", {})
        assert failed.is_error
        assert "the index is not loaded" in failed.content[0].text  # type: ignore[union-attr]

        refused = await client.call_tool(f"{cap}.add", {"a": "two"})  # the model refuses it
        assert refused.is_error
        assert "payload.a" in refused.content[0].text

    # The RequestID is a Reach request like any other: readable over HTTP.
    async with httpx.AsyncClient(trust_env=False) as http:
        r = await http.get(
            f"{mcp.gateway.url}/reach/requests/{request_id}",
            headers={"Authorization": f"Bearer {mcp.caller}"},
        )
    assert r.status_code == 200
    assert r.json()["result"] == {"sum": 5}


async def test_rules_hide_what_they_deny(mcp: Mcp) -> None:
    async with mcp.client("legacy", mcp.other) as client:
        assert (await client.list_tools()).tools == []
    reply = await rpc(mcp, "tools/call", {"name": f"{mcp.capability}.secret"})
    assert reply.status_code == 200
    error = reply.json()["error"]
    assert error["code"] == -32000, error
    assert error["data"]["type"] == "forbidden"


# -- the wire, by hand -------------------------------------------------------------------------


async def rpc(
    mcp: Mcp,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    token: str | None = "caller",
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    sent = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if token is not None:
        sent["Authorization"] = f"Bearer {mcp.caller if token == 'caller' else token}"
    body = raw
    if body is None:
        body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": method, "params": params or {}})
        body = body.encode()
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        return await http.post(mcp.url, content=body, headers={**sent, **(headers or {})})


async def test_no_token_is_401_with_the_protected_resource_metadata(mcp: Mcp) -> None:
    r = await rpc(mcp, "tools/list", token=None)
    assert r.status_code == 401
    challenge = r.headers["www-authenticate"]
    assert challenge.startswith("Bearer resource_metadata=")
    where = challenge.split('"')[1]
    assert where.endswith("/.well-known/oauth-protected-resource/mcp")
    async with httpx.AsyncClient(trust_env=False) as http:
        for url in (where, f"{mcp.gateway.url}/.well-known/oauth-protected-resource"):
            doc = (await http.get(url)).json()
            assert doc["resource"] == mcp.url
            assert doc["bearer_methods_supported"] == ["header"]
    bad = await rpc(mcp, "tools/list", token="not-a-token")
    assert bad.status_code == 401
    assert 'error="invalid_token"' in bad.headers["www-authenticate"]


@pytest.mark.parametrize(
    ("raw", "code", "status", "says"),
    [
        (b'{"jsonrpc": "2.0", "id": 1, "method": ', -32700, 400, "not valid JSON"),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', -32600, 400, "batches"),
        (b'{"id": 1, "method": "ping"}', -32600, 400, "jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": {}, "method": "ping"}', -32600, 400, "request id"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": []}', -32602, 200, "object"),
        (b'"ping"', -32600, 400, "JSON object"),
    ],
)
async def test_malformed_json_rpc_is_a_clear_error(
    mcp: Mcp, raw: bytes, code: int, status: int, says: str
) -> None:
    r = await rpc(mcp, "", raw=raw)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert says in r.json()["error"]["message"]


async def test_bad_calls_are_clear_errors(mcp: Mcp) -> None:
    cap = mcp.capability
    unknown = (await rpc(mcp, "tools/call", {"name": f"{cap}.nothing"})).json()["error"]
    assert unknown["code"] == -32602
    assert "unknown tool" in unknown["message"]
    # Of a capability no rule lets it call, the caller learns nothing (the door's 403).
    elsewhere = (await rpc(mcp, "tools/call", {"name": "nowhere.nothing"})).json()["error"]
    assert elsewhere["code"] == -32000
    assert elsewhere["data"]["type"] == "forbidden"
    nameless = (await rpc(mcp, "tools/call", {"name": "nodot"})).json()["error"]
    assert nameless["code"] == -32602
    not_object = (await rpc(mcp, "tools/call", {"name": f"{cap}.add", "arguments": [1]})).json()
    assert not_object["error"]["code"] == -32602
    deep: Any = {}
    for _ in range(100):
        deep = {"d": deep}
    too_deep = (await rpc(mcp, "tools/call", {"name": f"{cap}.echo", "arguments": deep})).json()
    assert too_deep["error"]["code"] == -32602
    assert "nested" in too_deep["error"]["message"]
    huge = await rpc(
        mcp, "tools/call", {"name": f"{cap}.echo", "arguments": {"t": "x" * (8 << 20)}}
    )
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == -32600
    method = (await rpc(mcp, "resources/list")).json()["error"]
    assert method["code"] == -32601
    assert "resources/list" in method["message"]
    modern = {"_meta": {"io.modelcontextprotocol/protocolVersion": "2099-01-01"}}
    modern["_meta"]["io.modelcontextprotocol/clientCapabilities"] = {}  # type: ignore[assignment]
    r = await rpc(mcp, "ping", modern, headers={"MCP-Protocol-Version": "2099-01-01"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == -32022
    assert MODERN in r.json()["error"]["data"]["supported"]
    gone = await rpc(mcp, "ping", headers={"Mcp-Session-Id": "r1.2025-11-25.forged.00"})
    assert gone.status_code == 404


def modern(method: str, **params: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A 2026-07-28 request's params (declaring the tasks extension) and headers."""
    capabilities = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": capabilities,
    }
    return {**params, "_meta": meta}, {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}


async def test_a_long_call_is_a_task_read_from_any_gateway_and_cancelled(mcp: Mcp) -> None:
    cap = mcp.capability
    quick, headers = modern("tools/call", name=f"{cap}.slow", arguments={"s": 0})
    answer = (await rpc(mcp, "tools/call", quick, headers=headers)).json()["result"]
    assert answer["resultType"] == "complete"  # done before it needed to be a task
    assert answer["structuredContent"] == {"slept": 0}

    params, headers = modern("tools/call", name=f"{cap}.slow", arguments={"s": 1.5})
    created = (await rpc(mcp, "tools/call", params, headers=headers)).json()["result"]
    assert created["resultType"] == "task", created
    assert created["status"] == "working"
    task_id = created["taskId"]
    assert created["_meta"]["reach/requestId"] == task_id

    # Another gateway (no worker of its own) reads the task from Temporal.
    async with GatewayProcess(mcp.gateway.stack, "reader", worker=False) as other:
        reader = Mcp(other, cap, mcp.caller, mcp.other)
        get, headers = modern("tasks/get", taskId=task_id)

        seen: list[dict[str, Any]] = []

        async def completed() -> bool:
            seen.append((await rpc(reader, "tasks/get", get, headers=headers)).json()["result"])
            return bool(seen[-1]["status"] == "completed")

        await wait_until(completed, timeout_s=30, every_s=0.2)
        assert seen[0]["status"] in ("working", "completed")
        assert seen[-1]["result"]["structuredContent"] == {"slept": 1.5}
        stranger = await rpc(reader, "tasks/get", get, headers=headers, token=mcp.other)
        assert stranger.json()["error"]["code"] == -32602  # not its task: no such task

    params, headers = modern("tools/call", name=f"{cap}.slow", arguments={"s": 9})
    long_id = (await rpc(mcp, "tools/call", params, headers=headers)).json()["result"]["taskId"]
    cancel, headers = modern("tasks/cancel", taskId=long_id)
    acked = (await rpc(mcp, "tasks/cancel", cancel, headers=headers)).json()["result"]
    assert acked["resultType"] == "complete"
    get, headers = modern("tasks/get", taskId=long_id)

    async def cancelled() -> bool:
        task = (await rpc(mcp, "tasks/get", get, headers=headers)).json()["result"]
        return bool(task["status"] == "cancelled")

    await wait_until(cancelled, timeout_s=30, every_s=0.2)


async def test_an_mcp_server_behind_reach_is_called_through_the_front(
    mcp: Mcp, tmp_path: Any
) -> None:
    """An MCP server registered by URL (Reach's MCP connector) is tools behind the front, its
    descriptions and schemas as it declared them, its content blocks passed on as they were."""
    server = await McpServerProcess(tmp_path, "stateless").start().ready()
    srv = f"{mcp.capability}-srv"
    admin = {"Authorization": f"Bearer {mcp.admin}"}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        body = {"protocol": "mcp", "service_address": server.url, "capability": srv}
        r = await http.post(f"{mcp.gateway.url}/reach/agents", json=body, headers=admin)
        assert r.status_code == 200, r.text
    async with mcp.client(MODERN) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools[f"{srv}.echo"].description == "Say the text back."
        assert tools[f"{srv}.lookup"].input_schema["properties"]["key"]["type"] == "string"
        assert tools[f"{srv}.lookup"].annotations is not None
        echoed = await client.call_tool(f"{srv}.echo", {"text": "through Reach"})
        assert echoed.content[0].text == "through Reach"  # type: ignore[union-attr]
        looked = await client.call_tool(f"{srv}.lookup", {"key": "k"})
        assert looked.structured_content == {"key": "k", "value": "K"}
        assert (looked.meta or {})["reach/requestId"].startswith("req-")


async def test_a_long_call_is_streamed_naming_its_request(mcp: Mcp) -> None:
    """Past SSE_AFTER_S (2 s) a client that accepts SSE gets a stream whose headers name the
    RequestID at once, a progress notification naming it, and the result as the last event."""
    params = {
        "name": f"{mcp.capability}.slow",
        "arguments": {"s": 3},
        "_meta": {"progressToken": "p-1", "reach/timeoutMs": 20000},
    }
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params}
    headers = {
        "Authorization": f"Bearer {mcp.caller}",
        "Accept": "application/json, text/event-stream",
    }
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30) as http,
        http.stream("POST", mcp.url, json=body, headers=headers) as r,
    ):
        assert r.headers["content-type"] == "text/event-stream"
        request_id = r.headers["x-reach-request-id"]
        events = [
            json.loads(line[len("data: ") :])
            async for line in r.aiter_lines()
            if line.startswith("data: ")
        ]
    assert events[0]["method"] == "notifications/progress"
    assert request_id in events[0]["params"]["message"]
    assert events[-1]["id"] == 9
    assert events[-1]["result"]["structuredContent"] == {"slept": 3}
    assert events[-1]["result"]["_meta"]["reach/requestId"] == request_id


async def test_2025_11_25_tasks_on_a_session(mcp: Mcp) -> None:
    """The handshake protocol's own tasks: declared at initialize, asked for with params.task,
    the result waited for with tasks/result."""
    init = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t"}}
    r = await rpc(mcp, "initialize", init)
    assert r.json()["result"]["capabilities"]["tasks"]["requests"] == {"tools": {"call": {}}}
    session = {"Mcp-Session-Id": r.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
    tools = (await rpc(mcp, "tools/list", headers=session)).json()["result"]["tools"]
    assert {t["execution"]["taskSupport"] for t in tools} == {"optional"}
    call = {"name": f"{mcp.capability}.slow", "arguments": {"s": 1}, "task": {"ttl": 60000}}
    created = (await rpc(mcp, "tools/call", call, headers=session)).json()["result"]
    task_id = created["task"]["taskId"]
    assert created["task"]["status"] == "working"
    result = (await rpc(mcp, "tasks/result", {"taskId": task_id}, headers=session)).json()
    assert result["result"]["structuredContent"] == {"slept": 1}
    assert result["result"]["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task_id}
    task = (await rpc(mcp, "tasks/get", {"taskId": task_id}, headers=session)).json()["result"]
    assert task["status"] == "completed"
    assert task["pollInterval"] == 1000


async def test_hostile_ids_and_hosts_are_clear_refusals(mcp: Mcp) -> None:
    # A lone surrogate (JSON lets `\ud800` through) in the id an answer repeats: was a 500.
    r = await rpc(mcp, "", raw=b'{"jsonrpc": "2.0", "id": "\\ud800", "method": "ping"}')
    assert r.status_code == 200, r.text
    assert r.content == b'{"jsonrpc":"2.0","id":"\\ud800","result":{}}'
    # A task id that cannot be a RequestID is no task, never sent on to Temporal (a 500 was).
    for task_id in ("\ud800", "x" * 300_000, "a\x00b"):
        params, headers = modern("tasks/get", taskId=task_id)
        r = await rpc(mcp, "tasks/get", params, headers=headers)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == -32602
        assert len(r.content) < 1000
    # The protected-resource metadata names the Host: only this gateway's (it is cached).
    async with httpx.AsyncClient(trust_env=False) as http:
        where = f"{mcp.gateway.url}/.well-known/oauth-protected-resource"
        assert (await http.get(where, headers={"Host": "evil.example"})).status_code == 403
        assert (await http.get(where)).json()["resource"] == mcp.url
