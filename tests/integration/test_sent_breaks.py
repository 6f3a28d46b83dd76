"""A break after a request was sent is an unknown outcome on every protocol (issue 25): a gRPC
agent SIGKILLed mid-call, an MQTT broker SIGKILLed after the request was published. A keyless
non-idempotent write then ends `outcome_unknown`, not retryable, naming the instance, and runs
once (the agents' ledger, examples/knowledge_retriever.py, counts executions); a request that
never left (the broker was already gone) stays a retryable refusal: it did not start. And an
attempt the call activity refuses unsent (another run holds its send-once claim) is reported at
once, never re-delivered to be refused again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from reach.policy.state import create_policy_state
from reach.store.redis import RedisStore
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, executions, invoke, rid, wait_until
from tests.integration.test_connector_mcp import registered
from tests.integration.test_connector_mqtt import OwnBroker
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("sent-breaks"))
    async with GatewayProcess(stack) as gw:
        yield gw


async def a_write_in_flight(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, ledger: Path
) -> tuple[str, asyncio.Task[httpx.Response]]:
    """A keyless `create` (not idempotent) that the agent has started running."""
    request_id = rid()
    call = asyncio.create_task(
        invoke(http, gateway, capability, "create", request_id=request_id, timeout_ms=30_000)
    )
    await wait_until(lambda: bool(executions(ledger, request_id)), 15, every_s=0.02)
    return request_id, call


def assert_unknown(r: httpx.Response, instance_id: str) -> None:
    assert r.status_code == 502, r.text
    body = r.json()
    error = body["error"]
    assert error["type"] == "transport_error", error
    # It ran; following `retryable` would run it twice.
    assert (error.get("outcome_unknown"), error["retryable"]) == (True, False), error
    assert body["instance_id"] == instance_id, body


async def test_a_grpc_agent_killed_mid_write_is_an_unknown_outcome(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        gateway,
        f"{capability}-grpc",
        capability,
        "--protocol",
        "grpc",
        "--ledger",
        str(ledger),
        "--delay-ms",
        "5000",
    ).ready()
    request_id, call = await a_write_in_flight(http, gateway, capability, ledger)
    agent.proc.kill()
    assert_unknown(await call, agent.instance_id)
    assert executions(ledger, request_id) == [agent.instance_id]


async def test_an_mqtt_broker_killed_after_the_publish_is_an_unknown_outcome(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    broker = OwnBroker(tmp_path)  # never the machine's 1883
    await broker.start()
    try:
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(
            gateway,
            f"{capability}-mqtt",
            capability,
            "--protocol",
            "mqtt",
            "--broker",
            broker.address,
            "--ledger",
            str(ledger),
            "--delay-ms",
            "5000",
        ).ready()
        request_id, call = await a_write_in_flight(http, gateway, capability, ledger)
        assert broker.proc is not None
        broker.proc.kill()  # SIGKILL: no DISCONNECT, the connection just ends
        assert_unknown(await call, agent.instance_id)
        assert executions(ledger, request_id) == [agent.instance_id]

        # With the broker gone nothing can be published: refused, not started, retryable.
        await broker.proc.wait()
        later = rid()
        r = await invoke(http, gateway, capability, "create", request_id=later, timeout_ms=10_000)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["type"] == "transport_error", error
        assert "outcome_unknown" not in error, error
        assert error["retryable"] is True, error
        assert executions(ledger, later) == []
        agent.proc.kill()
    finally:
        await broker.stop()


async def test_an_attempt_refused_unsent_is_reported_at_once_not_redelivered(
    temporal_server: str,
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    http: httpx.AsyncClient,
    capability: str,
) -> None:
    """A gateway on Redis; an MCP server's non-idempotent tool; attempt 1's send claimed by
    "another run" (one whose process was lost) before the request comes: the call activity
    refuses it unsent, and the request ends there, with that run's unknown outcome. It was
    re-delivered three times (0.5 s, 1 s, 2 s), each refused the same way."""
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    server = McpServerProcess(tmp_path, "stateless").start()
    store = RedisStore.from_url(redis_url, prefix=redis_prefix)
    try:
        async with GatewayProcess(stack) as gateway:
            await server.ready()
            async with registered(http, gateway, server, capability) as iid:
                request_id = rid()
                held = await create_policy_state(store).claim(
                    f"sent:{request_id}:1",
                    "a-lost-run 1",
                    300,  # the send-once claim's key
                )
                assert held == "a-lost-run 1"
                r = await invoke(
                    http,
                    gateway,
                    capability,
                    "count",
                    request_id=request_id,
                    payload={"tag": "refused"},
                    timeout_ms=30_000,
                )
                assert r.status_code == 502, r.text
                body = r.json()
                assert body["error"]["type"] == "transport_error", body
                assert (body["error"]["outcome_unknown"], body["error"]["retryable"]) == (
                    True,
                    False,
                )
                assert body["instance_id"] == iid, body
                assert [a["attempt"] for a in body["attempts"]] == [1], body["attempts"]
                assert server.count() == 0  # never sent by this run
    finally:
        server.stop()
        await store.aclose()
