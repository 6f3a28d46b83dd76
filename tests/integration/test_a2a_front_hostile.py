"""The A2A front against a hostile caller, on a real gateway with tokens and rules: its cards
and a message that names no skill show only what the caller's rules let it call (as the MCP
front's tools/list; a denied caller learns nothing of what exists), a body nested past
Python's stack is a JSON-RPC parse error, not the gateway's 500; a caller holds at most so many
open streams; and an open stream ends when its gateway stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from agent_reach_sdk import AgentRuntime
from gateway_api.a2a_front import MAX_STREAMS_PER_CALLER, RpcError, parse_call
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import ROOT, GatewayProcess, tokened_http_agent, wait_until

pytestmark = [pytest.mark.integration]


@dataclass
class Env:
    gateway: GatewayProcess
    capability: str  # alice may call all but `secret`
    hidden: str  # no rule allows anyone anything
    tokens: dict[str, str]

    async def get(self, path: str, who: str) -> httpx.Response:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            auth = {"Authorization": f"Bearer {self.tokens[who]}"}
            return await http.get(f"{self.gateway.url}{path}", headers=auth)

    async def post(self, capability: str, who: str, body: bytes) -> httpx.Response:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            headers = {"Authorization": f"Bearer {self.tokens[who]}"}
            return await http.post(
                f"{self.gateway.url}/a2a/{capability}", content=body, headers=headers
            )


@pytest.fixture(scope="module")
async def env(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("a2a-hostile")
    capability = f"hx-{uuid.uuid4().hex[:8]}"
    hidden = f"{capability}-hidden"
    config = yaml.safe_load((ROOT / "reach.yaml").read_text())
    config["reach"]["rules"] = [
        {
            "name": "alice",
            "caller": "alice",
            "target_capability": capability,
            "allowed_operations": ["*"],
            "denied_operations": ["secret"],
        },
        {
            "name": "carol",
            "caller": "carol",
            "target_capability": capability,
            "allowed_operations": ["slow"],
        },
    ]
    (tmp / "reach.yaml").write_text(yaml.safe_dump(config))
    store = FileTokenStore(tmp / "tokens.json")
    tokens = {}
    for name, kind in [
        ("alice", "caller"),
        ("bob", "caller"),
        ("carol", "caller"),
        ("agent", "agent"),
    ]:
        token, record = issue(name, kind, ["*"] if kind == "agent" else [])  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    stack = new_stack(temporal_server, tmp, extra={"REACH_CONFIG": str(tmp / "reach.yaml")})
    runtimes = []
    for name in (capability, hidden):
        runtime = AgentRuntime(
            name,
            protocol="http",
            service_address="127.0.0.1:0",
            heartbeat_interval=0.5,
            token=tokens["agent"],
        )
        for operation in ("echo", "secret"):
            runtime.operation(operation)(lambda payload: {"echo": payload})
        runtime.operation("slow")(slow)
        runtimes.append(runtime)
    async with GatewayProcess(stack) as gateway:
        for runtime in runtimes:
            runtime.reach_url = gateway.url
        async with runtimes[0], runtimes[1]:
            yield Env(gateway, capability, hidden, tokens)


async def slow(payload: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(float(payload.get("s", 0)))
    return {}


def send(**metadata: Any) -> bytes:
    message = {
        "messageId": uuid.uuid4().hex,
        "role": "ROLE_USER",
        "parts": [{"data": {"x": 1}}],
        "metadata": metadata,
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": message}}
    return json.dumps(body).encode()


def skills(card: httpx.Response) -> list[str]:
    assert card.status_code == 200, card.text
    return [skill["id"] for skill in card.json().get("skills", [])]


async def test_cards_show_only_what_the_callers_rules_allow(env: Env) -> None:
    assert skills(await env.get("/.well-known/agent-card.json", "alice")) == [env.capability]
    assert skills(await env.get("/.well-known/agent-card.json", "bob")) == []
    card = f"/a2a/{env.capability}/.well-known/agent-card.json"
    assert skills(await env.get(card, "alice")) == ["echo", "slow"]  # not the denied `secret`
    # A capability the caller may call nothing of is, to it, an unknown one.
    for who, capability in [("bob", env.capability), ("alice", env.hidden), ("bob", "nope")]:
        refused = await env.get(f"/a2a/{capability}/.well-known/agent-card.json", who)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["type"] == "unknown_capability"
        assert refused.json()["error"]["message"] == (
            f"no agent has registered capability {capability!r}"
        )


async def test_a_message_naming_no_skill_is_told_only_what_the_caller_may_call(env: Env) -> None:
    error = (await env.post(env.capability, "alice", send())).json()["error"]
    assert "2 operations you may call (echo, slow)" in error["message"], error
    for capability in (env.capability, env.hidden, "nope"):
        error = (await env.post(capability, "bob", send())).json()["error"]
        assert error["code"] == -32602, error
        assert "0 operations you may call (none)" in error["message"]
        assert "echo" not in error["message"]
        assert "secret" not in error["message"]
    denied = (await env.post(env.capability, "alice", send(operation="secret"))).json()["error"]
    assert denied["data"][0]["reason"] == "REACH_FORBIDDEN", denied  # the door's 403, audited


async def test_a_body_nested_past_the_stack_is_a_parse_error(env: Env) -> None:
    nested = b"[" * 200_000 + b"]" * 200_000  # within the body limit
    with pytest.raises(RpcError) as raised:
        parse_call(nested)
    assert raised.value.code == -32700
    answer = await env.post(env.capability, "alice", nested)
    assert answer.status_code == 200, answer.text  # not the 500 of a bug in Reach
    assert answer.json()["error"]["code"] == -32700


async def subscribe_to_a_slow_task(
    env: Env, caller: str
) -> tuple[dict[str, Any], str, dict[str, str]]:
    """`caller` starts a 20 s task (answered at once): the SubscribeToTask body that follows
    it, the front's URL and the caller's headers."""
    params = json.loads(send(operation="slow", timeout_ms=60_000))["params"]
    params["message"]["parts"] = [{"data": {"s": 20}}]
    params["configuration"] = {"returnImmediately": True}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params}
    answer = (await env.post(env.capability, caller, json.dumps(body).encode())).json()
    subscribe = {"jsonrpc": "2.0", "id": 2, "method": "SubscribeToTask"}
    subscribe["params"] = {"id": answer["result"]["task"]["id"]}
    headers = {"Authorization": f"Bearer {env.tokens[caller]}"}
    return subscribe, f"{env.gateway.url}/a2a/{env.capability}", headers


async def test_a_caller_holds_at_most_so_many_streams(env: Env) -> None:
    """Each open stream reads its task's history every 2 s: one token could hold as many as
    the gateway takes connections (1,000), ~500 history reads a second."""
    subscribe, url, headers = await subscribe_to_a_slow_task(env, "alice")
    limits = httpx.Limits(max_connections=MAX_STREAMS_PER_CALLER + 4)
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30, limits=limits, headers=headers) as http,
        contextlib.AsyncExitStack() as streams,
    ):

        async def stream() -> httpx.Response:
            response = await streams.enter_async_context(http.stream("POST", url, json=subscribe))
            assert response.headers["content-type"].startswith("text/event-stream")
            return response

        held = await asyncio.gather(*(stream() for _ in range(MAX_STREAMS_PER_CALLER)))
        refused = await http.post(url, json=subscribe)
        error = refused.json()["error"]
        assert error["data"][0]["reason"] == "REACH_RATE_LIMITED", error
        assert f"holds {MAX_STREAMS_PER_CALLER} open streams" in error["message"]
        assert refused.headers["retry-after"] == "1"
        await held[0].aclose()  # one let go of: room for one more

        async def room() -> bool:
            async with http.stream("POST", url, json=subscribe) as again:
                return again.headers["content-type"].startswith("text/event-stream")

        # The gateway frees the slot once it sees the disconnect (at the stream's next write
        # at the latest, every 2 s): on a loaded box that took over 10 s once.
        await wait_until(room, timeout_s=30)


async def test_streams_asked_for_at_once_are_bounded_too(env: Env) -> None:
    """Streams asked for at the same moment all passed the count while the first read its
    task (SubscribeToTask's describe): 192 racing subscribes by one token were all held."""
    subscribe, url, headers = await subscribe_to_a_slow_task(env, "carol")
    asked = 3 * MAX_STREAMS_PER_CALLER
    limits = httpx.Limits(max_connections=asked + 4)
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30, limits=limits, headers=headers) as http,
        contextlib.AsyncExitStack() as streams,
    ):

        async def stream() -> bool:
            response = await streams.enter_async_context(http.stream("POST", url, json=subscribe))
            return response.headers["content-type"].startswith("text/event-stream")

        held = await asyncio.gather(*(stream() for _ in range(asked)))
    assert held.count(True) == MAX_STREAMS_PER_CALLER, held.count(True)


@pytest.mark.parametrize("method", ["SendStreamingMessage", "SendMessage"])
async def test_a_call_its_caller_left_gives_its_room_back(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    """A SendStreamingMessage (or a blocking SendMessage) whose caller went away held its room
    among the bytes in flight until its task ended (the door still waited for its verdict), as
    an HTTP invoke whose client left does not: a caller opening and dropping calls of long
    tasks, one at a time, filled its share and was refused with nothing open."""
    tmp = tmp_path_factory.mktemp("a2a-left")
    capability = f"hx-left-{uuid.uuid4().hex[:6]}"
    tokened = tokened_http_agent(tmp, capability, ("dave", "caller"))
    runtime, (caller,) = tokened.runtime, tokened.tokens
    # Room for about 15 of these calls in this caller's share (the code before was refused at
    # the 16th): twice that many, one at a time, must all go through.
    extra = {"REACH_TRANSPORT__MAX_INFLIGHT_BYTES": "8000"}
    runtime.operation("slow")(slow)
    params = json.loads(send(operation="slow", timeout_ms=120_000))["params"]
    params["message"]["parts"] = [{"data": {"s": 60}}]
    body = {"jsonrpc": "2.0", "id": 3, "method": method, "params": params}
    headers = {"Authorization": f"Bearer {caller}"}
    async with GatewayProcess(new_stack(temporal_server, tmp, extra=extra)) as gateway:
        runtime.reach_url = gateway.url
        url = f"{gateway.url}/a2a/{capability}"
        async with runtime, httpx.AsyncClient(trust_env=False, timeout=30) as http:

            async def opened() -> bool:
                params["message"]["messageId"] = uuid.uuid4().hex
                if method == "SendMessage":  # left once it has waited a moment (started)
                    try:
                        refused = await http.post(url, json=body, headers=headers, timeout=0.5)
                    except httpx.ReadTimeout:
                        return True
                    assert "max_inflight_bytes" in refused.text, refused.text
                    return False
                async with http.stream("POST", url, json=body, headers=headers) as stream:
                    if not stream.headers["content-type"].startswith("text/event-stream"):
                        return False  # refused: the caller's share is full (until room is back)
                    first = await anext(aiter_data(stream.aiter_lines()))
                    return "task" in json.loads(first["data"])["result"]

            for _ in range(30):  # one at a time, each let go of after its first event
                await wait_until(opened, timeout_s=30)


async def test_a_blocking_call_its_caller_left_is_not_waited_for(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A blocking SendMessage whose caller went away was let go by the door (accepted), then
    its task's end was waited for all the same, up to its deadline, with nobody to answer: a
    waiter per dropped call, and a stopping gateway held by them (uvicorn waits for its
    requests' handlers: 'Waiting for background tasks to complete')."""
    tmp = tmp_path_factory.mktemp("a2a-left-wait")
    capability = f"hx-lw-{uuid.uuid4().hex[:6]}"
    runtime = AgentRuntime(
        capability, protocol="http", service_address="127.0.0.1:0", heartbeat_interval=0.5
    )
    runtime.operation("slow")(slow)
    params = json.loads(send(operation="slow", timeout_ms=120_000))["params"]
    params["message"]["parts"] = [{"data": {"s": 60}}]
    body = {"jsonrpc": "2.0", "id": 4, "method": "SendMessage", "params": params}
    gateway = GatewayProcess(new_stack(temporal_server, tmp))
    try:
        runtime.reach_url = (await gateway.ready()).url
        async with runtime, httpx.AsyncClient(trust_env=False, timeout=30) as http:
            with pytest.raises(httpx.ReadTimeout):  # the caller leaves its blocking call
                await http.post(f"{gateway.url}/a2a/{capability}", json=body, timeout=2)

            async def running() -> bool:
                query = {"capability": capability, "status": "running"}
                rows = (await http.get(f"{gateway.url}/reach/requests", params=query)).json()
                return len(rows["requests"]) == 1

            await wait_until(running, timeout_s=30)
            os.killpg(gateway.proc.popen.pid, signal.SIGTERM)
        await asyncio.to_thread(gateway.proc.popen.wait, 90)
        assert "Waiting for background tasks" not in gateway.proc.output()
    finally:
        gateway.proc.stop()


async def test_a_stream_ends_when_the_gateway_stops(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """uvicorn waits for every response still being sent before it stops: an open stream of a
    long task held a stopping gateway until the task ended (its deadline: up to a day)."""
    tmp = tmp_path_factory.mktemp("a2a-stops")
    capability = f"hx-stops-{uuid.uuid4().hex[:6]}"
    runtime = AgentRuntime(
        capability, protocol="http", service_address="127.0.0.1:0", heartbeat_interval=0.5
    )

    @runtime.operation("slow")
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(60)
        return {}

    gateway = GatewayProcess(new_stack(temporal_server, tmp))
    try:
        runtime.reach_url = (await gateway.ready()).url
        async with runtime, httpx.AsyncClient(trust_env=False, timeout=30) as http:
            url = f"{gateway.url}/a2a/{capability}"
            params = json.loads(send(operation="slow", timeout_ms=120_000))["params"]
            body = {"jsonrpc": "2.0", "id": 7, "method": "SendStreamingMessage", "params": params}
            async with http.stream("POST", url, json=body) as stream:
                lines = stream.aiter_lines()
                first = json.loads((await anext(aiter_data(lines)))["data"])
                assert first["result"]["task"]["status"]["state"] == "TASK_STATE_SUBMITTED"
                stopping = time.monotonic()
                os.killpg(gateway.proc.popen.pid, signal.SIGTERM)
                last = [event async for event in aiter_data(lines)][-1]
            assert time.monotonic() - stopping < 10  # not the task's 60 s
        # (The agent gone, its call in flight fails: the worker's shutdown waits for that.)
        assert last["event"] == "error", last
        error = json.loads(last["data"])["error"]
        assert error["data"][0]["reason"] == "REACH_UNAVAILABLE", error
        assert "the gateway is stopping" in error["message"]
        await asyncio.to_thread(gateway.proc.popen.wait, 30)
    finally:
        gateway.proc.stop()


async def aiter_data(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, str]]:
    """Server-sent events as {"event": ..., "data": ...}."""
    event: dict[str, str] = {"event": "message"}
    async for line in lines:
        if not line:
            if "data" in event:
                yield event
            event = {"event": "message"}
        elif ":" in line:
            name, _, value = line.partition(":")
            event[name] = value.strip()
