"""Instances registered by URL through a real gateway: a real A2A agent (a2a-sdk, its own
process) registered by `POST /reach/agents`, by `reach.yaml` `agents:` and by the CLI, shown,
invoked, probed out of routing while it is stopped and back when it answers again, removed; a
real MCP server (the mcp package) killed and restarted; refusals that name the problem
(docs/instances-by-url.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from agent_reach_sdk.wire import Answer, Inbound
from gateway_api.devserver import free_port
from tests.a2a_agents import SKILLS, A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import ROOT, GatewayProcess, Stack, invoke, path_server, wait_until
from tests.integration.test_grpc_front import front_address
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration

STATIC_CAPABILITY = f"static-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[A2AAgentProcess]:
    proc = A2AAgentProcess(tmp_path_factory.mktemp("a2a"), "by-url")
    try:
        yield await proc.ready()
    finally:
        proc.proc.stop()


@pytest.fixture(scope="module")
def stack(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return new_stack(temporal_server, tmp_path_factory.mktemp("by-url"))


@pytest.fixture(scope="module")
async def gateway(agent: A2AAgentProcess, stack: Stack) -> AsyncIterator[GatewayProcess]:
    stack.heartbeat_interval = 0.3
    stack.heartbeat_timeout = 1.5
    static = [
        {
            "protocol": "a2a",
            "url": agent.url,
            "capability": STATIC_CAPABILITY,
            "instance_id": "static-1",
            "operations": [{"name": "echo", "idempotent": True}],
        }
    ]
    stack.extra["REACH_AGENTS"] = json.dumps(static)
    async with GatewayProcess(stack) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        yield client


async def capability(http: httpx.AsyncClient, gw: GatewayProcess, name: str) -> dict[str, Any]:
    r = await http.get(f"{gw.url}/reach/capabilities/{name}")
    if r.status_code == 404:
        return {"instances": []}
    r.raise_for_status()
    found: dict[str, Any] = r.json()
    return found


def routable(detail: dict[str, Any]) -> list[str]:
    return [i["instance_id"] for i in detail["instances"] if i["status"] != "unhealthy"]


def audited(stack: Stack, event: str) -> list[dict[str, Any]]:
    path = stack.tmp / "audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("event") == event]


async def test_a_configured_agent_joins_at_start(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    async def joined() -> bool:
        return routable(await capability(http, gateway, STATIC_CAPABILITY)) == ["static-1"]

    await wait_until(joined, 15)
    (record,) = (await capability(http, gateway, STATIC_CAPABILITY))["instances"]
    assert record["registered_by_url"] is True
    assert record["declared"]["echo"]["idempotent"] is True  # reach.yaml over the card


async def test_register_show_invoke_and_the_probe_out_and_back(
    gateway: GatewayProcess, agent: A2AAgentProcess, stack: Stack, http: httpx.AsyncClient
) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    body = {"protocol": "a2a", "service_address": agent.url, "capability": cap}
    r = await http.post(f"{gateway.url}/reach/agents", json=body)
    assert r.status_code == 200, r.text
    ack = r.json()
    instance_id = ack["instance_id"]
    assert instance_id.startswith("a2a-127.0.0.1-")
    assert ack["registered_by_url"] is True
    assert {op["name"] for op in ack["operations"]} == set(SKILLS)
    assert ack["details"]
    again = await http.post(f"{gateway.url}/reach/agents", json=body)
    assert again.json()["instance_id"] == instance_id  # the same URL, the same id

    (record,) = (await capability(http, gateway, cap))["instances"]
    assert record["registered_by_url"] is True
    assert record["details"] == ack["details"]
    assert record["declared"]["echo"]["description"] == SKILLS["echo"]

    r = await invoke(http, gateway, cap, "echo", payload={"hello": "a2a"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success"

    async def probed() -> bool:
        (seen,) = (await capability(http, gateway, cap))["instances"]
        return bool(seen["checks"].get("probe") == "ok")

    await wait_until(probed, 10)

    agent.proc.kill(signal.SIGSTOP)  # it answers nothing: probes time out
    try:
        gone = await wait_until(lambda: _none_routable(http, gateway, cap), 15)
    finally:
        agent.proc.kill(signal.SIGCONT)
    assert gone < 10
    back = await wait_until(lambda: _routable(http, gateway, cap, instance_id), 15)
    assert back < 10

    def transitions() -> bool:
        mine = lambda event: [e for e in audited(stack, event) if e.get("instance") == instance_id]  # noqa: E731
        return len(mine("probe_failed")) == 1 and len(mine("probe_recovered")) == 1

    await wait_until(transitions, 10)  # once per transition, though every probe failed
    r = await invoke(http, gateway, cap, "echo", payload={"hello": "again"})
    assert r.json()["status"] == "success"


async def _none_routable(http: httpx.AsyncClient, gw: GatewayProcess, cap: str) -> bool:
    return routable(await capability(http, gw, cap)) == []


async def _routable(http: httpx.AsyncClient, gw: GatewayProcess, cap: str, iid: str) -> bool:
    return routable(await capability(http, gw, cap)) == [iid]


async def test_refusals_name_the_problem(gateway: GatewayProcess, http: httpx.AsyncClient) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    url = f"{gateway.url}/reach/agents"
    nobody = f"http://127.0.0.1:{free_port()}"
    r = await http.post(url, json={"protocol": "a2a", "service_address": nobody, "capability": cap})
    assert r.status_code in (502, 503), r.text
    assert r.json()["error"]["type"] in ("transport_error", "unavailable")

    async def junk(request: Inbound) -> Answer:
        return Answer(200, {"name": 5, "skills": "none"})

    server = path_server(junk)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        r = await http.post(
            url, json={"protocol": "a2a", "service_address": base, "capability": cap}
        )
    finally:
        await server.close()
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_request"
    assert "card" in r.json()["error"]["message"]

    r = await http.post(
        url, json={"protocol": "a2a", "service_address": "127.0.0.1:9", "capability": cap}
    )
    assert r.status_code == 422, r.text
    r = await http.post(
        url, json={"protocol": "http", "service_address": "127.0.0.1:9", "capability": cap}
    )
    assert r.status_code == 422
    assert "instance_id" in r.json()["error"]["message"]
    assert (await capability(http, gateway, cap))["instances"] == []


def reach_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(ROOT),
        env={"PATH": "/usr/bin:/bin", "REACH_CONFIG": str(ROOT / "reach.yaml")},
    )


async def test_the_cli_adds_and_removes(
    gateway: GatewayProcess, agent: A2AAgentProcess, http: httpx.AsyncClient
) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    gw = ["--gateway", gateway.url]
    added = await asyncio.to_thread(
        reach_cli,
        "agents",
        "add",
        "a2a",
        agent.url,
        "--capability",
        cap,
        "--instance-id",
        "cli-1",
        *gw,
    )
    assert added.returncode == 0, added.stderr
    assert "registered cli-1" in added.stdout
    assert "remove: reach agents remove cli-1" in added.stdout  # the id to copy, not "ID"
    assert "echo" in added.stdout
    assert routable(await capability(http, gateway, cap)) == ["cli-1"]
    removed = await asyncio.to_thread(reach_cli, "agents", "remove", "cli-1", *gw)
    assert removed.returncode == 0, removed.stderr
    assert (await capability(http, gateway, cap))["instances"] == []
    # A probe round after the removal (another instance's first probe) leaves it removed.
    witness = {"protocol": "a2a", "service_address": agent.url + "/", "capability": cap}
    witness["instance_id"] = "witness-1"
    assert (await http.post(f"{gateway.url}/reach/agents", json=witness)).status_code == 200

    async def witnessed() -> bool:
        found = {i["instance_id"]: i for i in (await capability(http, gateway, cap))["instances"]}
        return found.get("witness-1", {}).get("checks", {}).get("probe") == "ok"

    await wait_until(witnessed, 10)
    assert routable(await capability(http, gateway, cap)) == ["witness-1"]
    unknown = await asyncio.to_thread(reach_cli, "agents", "remove", "cli-1", *gw)
    assert unknown.returncode == 1


@pytest.fixture(scope="module")
async def mcp_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[McpServerProcess]:
    server = McpServerProcess(tmp_path_factory.mktemp("mcp"), "stateless")
    try:
        yield await server.start().ready()
    finally:
        server.stop()


async def test_an_mcp_server_killed_and_restarted_leaves_and_comes_back(
    gateway: GatewayProcess, mcp_server: McpServerProcess, http: httpx.AsyncClient
) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    body = {"protocol": "mcp", "service_address": mcp_server.url, "capability": cap}
    r = await http.post(f"{gateway.url}/reach/agents", json=body)
    assert r.status_code == 200, r.text
    instance_id = r.json()["instance_id"]
    assert instance_id.startswith("mcp-127.0.0.1-")
    (record,) = (await capability(http, gateway, cap))["instances"]
    assert record["details"].get("protocol_version")
    lookup = record["declared"]["lookup"]
    assert lookup["description"] == "Look a key up."
    assert lookup["idempotent"] is True  # readOnlyHint
    assert lookup["input_schema"]["properties"]["key"]
    r = await invoke(http, gateway, cap, "lookup", payload={"key": "q"})
    assert r.json()["result"] == {"key": "q", "value": "Q"}, r.text

    mcp_server.kill()
    await wait_until(lambda: _none_routable(http, gateway, cap), 15)
    await mcp_server.start().ready()
    await wait_until(lambda: _routable(http, gateway, cap, instance_id), 15)
    r = await invoke(http, gateway, cap, "lookup", payload={"key": "z"})
    assert r.json()["result"] == {"key": "z", "value": "Z"}, r.text


async def test_a_grpc_join_naming_a2a_is_a_registration_by_url(
    gateway: GatewayProcess, agent: A2AAgentProcess, http: httpx.AsyncClient
) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    async with grpc.aio.insecure_channel(front_address(gateway)) as channel:
        join = channel.unary_unary(
            "/reach.v1.Reach/Join",
            request_serializer=pb.JoinRequest.SerializeToString,
            response_deserializer=pb.JoinAck.FromString,
        )
        request = pb.JoinRequest(
            capability=cap, instance_id="grpc-1", protocol="a2a", service_address=agent.url
        )
        ack = await join(request, timeout=30)
    assert ack.instance_id == "grpc-1"
    (record,) = (await capability(http, gateway, cap))["instances"]
    assert record["registered_by_url"] is True
    assert set(record["operations"]) == set(SKILLS)


@pytest.mark.slow
async def test_gateways_sharing_redis_share_registrations_and_keep_an_instance_alive(
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    agent: A2AAgentProcess,
    http: httpx.AsyncClient,
) -> None:
    """Registered through one gateway, probed by every gateway on the registry's Redis: once
    that gateway is gone, another keeps the instance in routing."""
    made = [
        new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            key_prefix=redis_prefix,
            heartbeat_interval=0.3,
            heartbeat_timeout=1.5,
        )
        for _ in range(2)
    ]
    first, second = GatewayProcess(made[0], "first"), GatewayProcess(made[1], "second")
    try:
        await asyncio.gather(first.ready(), second.ready())
        cap = f"cap-{uuid.uuid4().hex[:8]}"
        body = {"protocol": "a2a", "service_address": agent.url, "capability": cap}
        r = await http.post(f"{first.url}/reach/agents", json=body)
        assert r.status_code == 200, r.text
        instance_id = r.json()["instance_id"]

        async def probed_by(gw: GatewayProcess) -> bool:
            text = (await http.get(f"{gw.url}/metrics")).text
            return f'reach_probes_total{{capability="{cap}",outcome="ok"' in text

        (before,) = (await capability(http, second, cap))["instances"]
        first.proc.kill()
        killed_at = time.time()

        async def kept_alive() -> bool:
            # Heartbeaten by a probe past a whole heartbeat timeout after the first gateway
            # went (while that one was alive, the second may have found each probe done).
            (seen,) = (await capability(http, second, cap))["instances"]
            return bool(seen["last_seen"] > killed_at + 1.5 and seen["status"] == "ok")

        await wait_until(kept_alive, 15)
        (after,) = (await capability(http, second, cap))["instances"]
        assert after["joined_at"] == before["joined_at"]  # never expired and joined again
        assert await probed_by(second)
        assert await _routable(http, second, cap, instance_id)
        r = await invoke(http, second, cap, "echo", payload={"via": "second"})
        assert r.json()["status"] == "success", r.text
    finally:
        first.proc.stop()
        second.proc.stop()
