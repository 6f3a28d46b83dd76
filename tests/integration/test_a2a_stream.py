"""Following an A2A task by its stream (SubscribeToTask), with a real gateway, the dev server
and a2a-sdk agents whose cards say they stream and do not push: the task followed by its
stream ends as the agent finishes (one subscription, one GetTask after the end, one look), a
stream cut mid-task falls back to polling and still ends right, and an agent whose card says
it does not stream is polled. Each agent's own count shows one message per request.

The lag printed (from the agent's completion to Reach's answer) is the figure for the docs:
by the stream it is the stream's event and one GetTask; by polling, up to the poll's pause."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client as TemporalClient

from tests.a2a_agents import A2AAgentProcess
from tests.helpers import GatewayProcess

pytestmark = pytest.mark.integration

AGENTS = {"a2a-streams": "", "a2a-stream-cut": "break", "a2a-no-stream": "off"}


@pytest.fixture(scope="module")
async def agents(
    gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[dict[str, A2AAgentProcess]]:
    tmp = tmp_path_factory.mktemp("a2a-stream")
    procs = {cap: A2AAgentProcess(tmp, cap, stream=mode) for cap, mode in AGENTS.items()}
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            for cap, proc in procs.items():
                await proc.ready()
                r = await http.post(
                    f"{gateway.url}/reach/agents",
                    json={
                        "capability": cap,
                        "instance_id": f"{cap}-1",
                        "protocol": "a2a",
                        "service_address": proc.url,
                    },
                )
                assert r.status_code == 200, r.text
        yield procs
    finally:
        for proc in procs.values():
            proc.proc.stop()


async def slow_task(
    http: httpx.AsyncClient, gateway: GatewayProcess, agent: A2AAgentProcess, cap: str, s: float
) -> tuple[dict[str, Any], dict[str, int], float]:
    """A `slow` task of `s` seconds: Reach's answer, the agent's counts it added, and how
    long after the agent completed the task Reach answered."""
    before = (await agent.counts())["counts"]
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": cap, "operation": "slow", "payload": {"seconds": s}, "timeout_ms": 60_000},
    )
    answered = time.time()
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["status"] == "success", body
    assert body["result"]["data"] == [{"done": True, "seconds": s}]
    seen = await agent.counts()
    added = {k: v - before.get(k, 0) for k, v in seen["counts"].items()}
    lag = answered - max(seen["done_at"].values())
    print(f"{cap}: the end noticed {lag * 1000:.0f} ms after the agent completed; {added}")
    return body, added, lag


async def looks(temporal: str, request_id: str) -> int:
    client = await TemporalClient.connect(temporal)
    handle = client.get_workflow_handle(request_id)
    events = [e async for e in handle.fetch_history_events()]
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "reach.follow_task"
    )


async def test_a_task_followed_by_its_stream_ends_as_the_agent_finishes(
    gateway: GatewayProcess,
    agents: dict[str, A2AAgentProcess],
    http: httpx.AsyncClient,
    temporal_server: str,
) -> None:
    body, added, lag = await slow_task(http, gateway, agents["a2a-streams"], "a2a-streams", 2)
    assert added["total"] == 1, added  # one message
    assert added["slow"] == 1, added
    assert added["subscribed"] == 1, added  # followed by its stream, never polled:
    assert added.get("get_task", 0) <= 1, added  # one GetTask, after the stream said so
    assert await looks(temporal_server, body["request_id"]) == 1
    assert lag < 2.0, lag  # seen as it ended (polling alone can be ~1 s late)


async def test_a_stream_cut_mid_task_falls_back_to_polling(
    gateway: GatewayProcess,
    agents: dict[str, A2AAgentProcess],
    http: httpx.AsyncClient,
    temporal_server: str,
) -> None:
    cut = agents["a2a-stream-cut"]
    body, added, _ = await slow_task(http, gateway, cut, "a2a-stream-cut", 3)
    assert added["total"] == 1, added  # one message, never sent again
    assert added["slow"] == 1, added
    assert added["subscribed"] == 1, added
    assert added["stream_broken"] == 1, added
    assert added["get_task"] >= 2, added  # the look at the break, then the poll's
    assert await looks(temporal_server, body["request_id"]) >= 2


async def test_an_agent_whose_card_says_it_does_not_stream_is_polled(
    gateway: GatewayProcess, agents: dict[str, A2AAgentProcess], http: httpx.AsyncClient
) -> None:
    _, added, _ = await slow_task(http, gateway, agents["a2a-no-stream"], "a2a-no-stream", 2)
    assert added["total"] == 1
    assert added.get("subscribed", 0) == 0, added
    assert added["get_task"] >= 2, added
