"""Join/Ack, heartbeat and eviction through the gateway's HTTP API (R2, R8, R11a, R21)."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from agent_reach_sdk import AgentRuntime
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, start_agents, wait_until

pytestmark = pytest.mark.integration


async def test_join_negotiates_parameters(gateway: GatewayProcess, http: httpx.AsyncClient) -> None:
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": "negotiator",
            "instance_id": "neg-01",
            "protocol": "http",
            "service_address": "127.0.0.1:1",
            "heartbeat_interval": 60,
            "operations": ["query"],
            "max_message_bytes": 1 << 30,
            "async_callback": True,
        },
    )
    assert r.status_code == 200, r.text
    ack = r.json()
    assert ack["heartbeat_timeout"] == 3.0  # the test stack's setting
    assert ack["heartbeat_interval"] == 1.5  # clamped: two heartbeats fit in one timeout
    assert ack["max_message_bytes"] == 1024 * 1024  # the smaller of the two
    assert ack["async_callback"] is True
    hb = await http.put(f"{gateway.url}/reach/agents/neg-01/heartbeat", json={"status": "degraded"})
    assert hb.status_code == 200
    assert hb.json()["status"] == "degraded"
    gone = await http.delete(f"{gateway.url}/reach/agents/neg-01")
    assert gone.status_code == 204
    again = await http.put(f"{gateway.url}/reach/agents/neg-01/heartbeat", json={})
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "unknown_instance"


async def test_join_with_unknown_protocol_is_422(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": "x",
            "instance_id": "x-1",
            "protocol": "carrier-pigeon",
            "service_address": "127.0.0.1:1",
        },
    )
    assert r.status_code == 422
    assert "carrier-pigeon" in r.json()["error"]["message"]
    assert "http" in r.json()["error"]["message"]


async def test_join_declares_operations_by_name_or_object(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    body = {
        "capability": capability,
        "instance_id": f"{capability}-01",
        "service_address": "127.0.0.1:1",
        "operations": [
            "stats",
            {"name": "query", "idempotent": True, "timeout_ms": 3000},
            {"name": "index", "idempotent": False},
            {"name": "warm"},
        ],
    }
    r = await http.post(f"{gateway.url}/reach/agents", json=body)
    assert r.status_code == 200, r.text
    listed = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
    [instance] = listed["instances"]
    assert instance["operations"] == ["stats", "query", "index", "warm"]
    assert instance["declared"] == {
        "query": {"name": "query", "idempotent": True, "timeout_ms": 3000},
        "index": {"name": "index", "idempotent": False},  # what it left unsaid is not stored
    }
    for operations, message in [
        (
            [{"name": "query", "idempotnt": True}],
            "operations.0.idempotnt: Extra inputs are not permitted",
        ),
        (
            ["query", {"name": "query", "timeout_ms": 10}],
            "operations: Value error, operation 'query' is listed more than once",
        ),
        (
            ["stats", {"name": "query", "timeout_ms": 86_400_001}],
            "operations.1.timeout_ms: Input should be less than or equal to 86400000",
        ),
    ]:
        r = await http.post(f"{gateway.url}/reach/agents", json={**body, "operations": operations})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["type"] == "invalid_request"
        assert r.json()["error"]["message"] == message
    # The refused joins changed nothing.
    again = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
    assert again["instances"][0]["declared"] == instance["declared"]


async def test_join_weight_and_max_inflight_are_checked_and_shown(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    body = {"capability": capability, "service_address": "127.0.0.1:1"}
    for fields, name in (
        ({"weight": 0}, "weight"),
        ({"weight": 1001}, "weight"),
        ({"max_inflight": 0}, "max_inflight"),
    ):
        r = await http.post(
            f"{gateway.url}/reach/agents", json={**body, "instance_id": f"{capability}-0", **fields}
        )
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"].startswith(f"{name}: "), r.text
    assert not (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).is_success
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={**body, "instance_id": f"{capability}-3", "weight": 3, "max_inflight": 5},
    )
    assert r.status_code == 200, r.text
    listed = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
    [instance] = listed["instances"]
    assert (instance["weight"], instance["max_inflight"]) == (3, 5)


async def test_the_sdk_joins_with_weight_and_max_inflight(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    runtime = AgentRuntime(
        capability,
        reach_address=gateway.url,
        instance_id=f"{capability}-sdk",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
        weight=4,
        max_inflight=9,
    )

    @runtime.operation("query")
    def query(payload: dict[str, object]) -> dict[str, object]:
        return payload

    async with runtime:
        listed = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
    [instance] = listed["instances"]
    assert (instance["weight"], instance["max_inflight"]) == (4, 9)


async def test_silent_instance_is_evicted_within_timeout_plus_interval(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """R11(a) with the test stack's heartbeat_timeout=3s, interval=0.5s."""
    agents = await start_agents(gateway, capability, 2)
    agents[0].proc.kill(signal.SIGSTOP)  # alive but silent: no more heartbeats
    stopped = time.monotonic()
    try:

        async def evicted() -> bool:
            r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
            ids = {i["instance_id"] for i in r.json()["instances"]}
            return ids == {agents[1].instance_id}

        await wait_until(evicted, 10, every_s=0.05)
        took = time.monotonic() - stopped
        assert took <= 3.0 + 0.5 + 0.3, took
        # Requests go to the healthy instance only.
        for _ in range(4):
            r = await http.post(
                f"{gateway.url}/reach/invoke",
                json={"target": capability, "operation": "query", "timeout_ms": 3000},
            )
            assert r.json()["instance_id"] == agents[1].instance_id
    finally:
        agents[0].proc.kill(signal.SIGCONT)
    assert "evicted" in gateway.proc.output()


async def test_agent_rejoins_after_the_gateway_forgets_it(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    agent = await Agent(gateway, f"{capability}-01", capability).ready()
    r = await http.delete(f"{gateway.url}/reach/agents/{agent.instance_id}")
    assert r.status_code == 204

    async def back() -> bool:
        r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
        return [i["instance_id"] for i in r.json()["instances"]] == [agent.instance_id]

    await wait_until(back, 5)
    assert "joining again" in agent.proc.output()


# `make test-slow`: test_agent_rejoins_after_the_gateway_forgets_it covers the same rejoin (a
# heartbeat answered 404, the agent joins again) in `make test` without restarting a gateway.
@pytest.mark.slow
async def test_agent_rejoins_a_restarted_gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, http: httpx.AsyncClient
) -> None:
    """A memory registry starts empty after a restart; agents notice (404) and join again."""
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("restart"))
    first = await GatewayProcess(stack, "first").ready()
    agent = await Agent(first, "phoenix-01", "phoenix").ready()
    first.proc.stop()
    second = await GatewayProcess(stack, "second", port=first.port).ready()

    async def rejoined() -> bool:
        r = await http.get(f"{second.url}/reach/capabilities/phoenix")
        return r.status_code == 200 and len(r.json()["instances"]) == 1

    await wait_until(rejoined, 10)
    r = await http.post(
        f"{second.url}/reach/invoke", json={"target": "phoenix", "operation": "query"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["instance_id"] == agent.instance_id
