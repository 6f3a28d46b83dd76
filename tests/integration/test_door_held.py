"""What the door holds, and for whom (issue 25, "Unbounded at the door"), against a real gateway,
agent and Temporal dev server with tokens required: one caller's share of the bytes in flight;
requests that are let go (A2A returnImmediately, an MCP task, an HTTP client that disconnected)
hold no room once durable; an undeclared operation is one metric label; a refusal's trace is
its own caller's."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, rid, wait_until

pytestmark = pytest.mark.integration

INFLIGHT_BYTES = 1_500_000  # a caller's share (half) holds one ~700 KB body, not two
BIG = 700_000
SLOW_MS = 8000  # the agent's answer: longer than every wait below for a room to come back
SLOW = "held-slow"
MODERN = "2026-07-28"


@dataclass
class Env:
    gateway: GatewayProcess
    tokens: dict[str, str]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}


@pytest.fixture(scope="module")
async def env(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("held")
    store = FileTokenStore(tmp / "tokens.json")
    tokens = {}
    for name, kind in [
        ("alice", "caller"),
        ("bob", "caller"),
        ("agent", "agent"),
        ("ops", "admin"),
    ]:
        token, record = issue(name, kind, ["*"] if kind == "agent" else [])  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    stack = new_stack(
        temporal_server,
        tmp,
        extra={"REACH_TRANSPORT__MAX_INFLIGHT_BYTES": str(INFLIGHT_BYTES)},
    )
    async with GatewayProcess(stack) as gw:
        agent = Agent(
            gw,
            "held-slow-1",
            SLOW,
            "--delay-ms",
            str(SLOW_MS),
            env={"REACH_AGENT_TOKEN": tokens["agent"]},
        )
        await agent.ready()
        yield Env(gw, tokens)
        agent.proc.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        yield client


def big(request_id: str | None = None, size: int = BIG) -> dict[str, Any]:
    body: dict[str, Any] = {
        "target": SLOW,
        "operation": "query",
        "payload": {"text": "word " * (size // 5)},
        "timeout_ms": 30_000,
    }
    if request_id:
        body["request_id"] = request_id
    return body


async def invoke(
    env: Env, http: httpx.AsyncClient, who: str, body: dict[str, Any]
) -> httpx.Response:
    return await http.post(f"{env.gateway.url}/reach/invoke", json=body, headers=env.auth(who))


async def started(env: Env, http: httpx.AsyncClient, who: str, request_id: str) -> bool:
    r = await http.get(f"{env.gateway.url}/reach/requests/{request_id}", headers=env.auth(who))
    return r.status_code == 200


async def admitted_again(env: Env, http: httpx.AsyncClient, who: str) -> None:
    """Within a few seconds (well before the slow agent answers anything it holds), `who`'s
    next big invoke is admitted: its room came back. The invoke runs in the background."""
    held: list[asyncio.Task[httpx.Response]] = []

    async def admitted() -> bool:
        probe = rid()
        task = asyncio.create_task(invoke(env, http, who, big(probe)))
        held.append(task)
        ok = await wait_until_either(task, lambda: started(env, http, who, probe))
        return ok

    await wait_until(admitted, timeout_s=SLOW_MS / 1000 / 2, every_s=0.3)
    for task in held:
        task.cancel()


async def wait_until_either(task: asyncio.Task[httpx.Response], condition: Any) -> bool:
    """True once `condition` holds (the request started); False if `task` ended first refused."""
    while not task.done():
        if await condition():
            return True
        await asyncio.sleep(0.05)
    return task.result().status_code == 200


async def test_one_caller_holds_at_most_its_share_and_another_is_served(
    env: Env, http: httpx.AsyncClient
) -> None:
    first = rid()
    hog = asyncio.create_task(invoke(env, http, "alice", big(first)))
    await wait_until(lambda: started(env, http, "alice", first), timeout_s=15)
    # Alice holds ~700 KB of her 750 KB share: her next big body is refused, not started.
    refused_id = rid()
    r = await invoke(env, http, "alice", big(refused_id))
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "unavailable"
    assert error["retryable"] is True
    assert "transport.caller_inflight_share" in error["message"]
    assert r.headers["retry-after"] == "1"
    assert not await started(env, http, "alice", refused_id)
    # The rest of the room is Bob's.
    served = await invoke(env, http, "bob", big())
    assert served.status_code == 200, served.text
    assert (await hog).status_code == 200


async def a2a(env: Env, http: httpx.AsyncClient, who: str) -> dict[str, Any]:
    message = {
        "messageId": uuid.uuid4().hex,
        "role": "ROLE_USER",
        "parts": [{"data": {"text": "word " * (BIG // 5)}}],
        "metadata": {"operation": "query", "timeout_ms": 30_000},
    }
    params = {"message": message, "configuration": {"returnImmediately": True}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params}
    r = await http.post(f"{env.gateway.url}/a2a/{SLOW}", json=body, headers=env.auth(who))
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def test_return_immediately_holds_no_room_once_submitted(
    env: Env, http: httpx.AsyncClient
) -> None:
    """Three ~700 KB returnImmediately sends in a row from one caller, each submitted at once,
    and then a big sync invoke of the same caller: none of them is held by the gateway (with
    the room held until the verdict, the second was refused past the caller's share)."""
    ids = []
    for _ in range(3):
        answer = await a2a(env, http, "alice")
        assert "error" not in answer, answer
        task = answer["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_SUBMITTED"
        ids.append(task["id"])
    await admitted_again(env, http, "alice")

    # Their results are read from their workflows later (GetTask).
    async def completed() -> bool:
        get = {"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": ids[-1]}}
        r = await http.post(f"{env.gateway.url}/a2a/{SLOW}", json=get, headers=env.auth("alice"))
        return bool(r.json()["result"]["status"]["state"] == "TASK_STATE_COMPLETED")

    await wait_until(completed, timeout_s=SLOW_MS / 1000 + 20, every_s=0.5)


async def test_an_mcp_task_holds_no_room_once_it_is_a_task(
    env: Env, http: httpx.AsyncClient
) -> None:
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {
            "extensions": {"io.modelcontextprotocol/tasks": {}}
        },
    }
    headers = {
        **env.auth("bob"),
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
    }
    for n in range(3):
        params = {
            "name": f"{SLOW}.query",
            "arguments": {"text": "word " * (BIG // 5)},
            "_meta": {**meta, "reach/timeoutMs": 30_000},
        }
        body = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params}
        r = await http.post(f"{env.gateway.url}/mcp", json=body, headers=headers)
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        assert result["resultType"] == "task", result
    await admitted_again(env, http, "bob")


async def test_an_http_client_that_went_away_holds_no_room(
    env: Env, http: httpx.AsyncClient
) -> None:
    gone = rid()
    # ~1 MB: with it held, no other ~700 KB body fits in the bound, whoever sends it.
    raw = json.dumps(big(gone, size=1_000_000)).encode()
    _reader, writer = await asyncio.open_connection("127.0.0.1", env.gateway.port)
    head = (
        f"POST /reach/invoke HTTP/1.1\r\nhost: 127.0.0.1:{env.gateway.port}\r\n"
        f"authorization: Bearer {env.tokens['alice']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode()
    writer.write(head + raw)
    await writer.drain()
    await wait_until(lambda: started(env, http, "alice", gone), timeout_s=15)
    writer.close()  # gone while its request runs: it goes on durably, held for nobody
    await admitted_again(env, http, "alice")

    async def ended() -> bool:
        r = await http.get(f"{env.gateway.url}/reach/requests/{gone}", headers=env.auth("alice"))
        return bool(r.json()["status"] == "success")

    await wait_until(ended, timeout_s=SLOW_MS / 1000 + 20, every_s=0.5)


async def test_undeclared_operations_are_one_metric_label(
    env: Env, http: httpx.AsyncClient
) -> None:
    names = [f"made-up-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for name in names:
        body = {"target": SLOW, "operation": name, "payload": {}, "timeout_ms": 15_000}
        r = await invoke(env, http, "bob", body)
        assert r.json()["status"] == "error", r.text
    scraped = await http.get(f"{env.gateway.url}/metrics", headers=env.auth("ops"))
    assert scraped.status_code == 200, scraped.text
    metrics = scraped.text
    lines = [line for line in metrics.splitlines() if line.startswith("reach_invokes_total{")]
    assert not [line for line in lines if any(name in line for name in names)], lines
    folded = [line for line in lines if f'capability="{SLOW}"' in line and "_other" in line]
    assert [line.split()[-1] for line in folded if 'operation="_other"' in line] == ["3.0"], lines


async def test_a_refusal_trace_is_its_own_callers(env: Env, http: httpx.AsyncClient) -> None:
    """Alice and Bob are both refused under one RequestID (a capability nobody registered):
    each one's trace tells its own refusal, not the latest of anyone's."""
    shared = rid()
    for who in ("alice", "bob"):
        body = {"target": f"nothing-{who}", "operation": "x", "payload": {}, "request_id": shared}
        r = await invoke(env, http, who, body)
        assert r.status_code == 404, r.text
    for who in ("alice", "bob"):
        r = await http.get(
            f"{env.gateway.url}/reach/requests/{shared}/timeline", headers=env.auth(who)
        )
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        assert "refused at the door" in message, message
        assert f"nothing-{who}" in message, message
