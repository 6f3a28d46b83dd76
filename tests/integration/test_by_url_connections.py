"""Connections to instances registered by URL (MCP servers, A2A agents) through a real gateway:
the connection sweep (`connectors.ConnectorSet.sweep`, every second) keeps a live instance's
and closes those of one that left.

An MCP server's connection is first opened by its discovery (under the `discovery` capability,
for no instance); a call then uses it. Before that connection became the instance's under its
own capability, the sweep asked the registry about the instance under `discovery`, found
nothing, and closed a live server's connections (its MCP session with them) within a second
of each call."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

from tests.a2a_agents import A2AAgentProcess
from tests.helpers import GatewayProcess, invoke, wait_until
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration

# What each protocol's test instance answers at once: the operation and its payload.
CALLS = {"mcp": ("echo", {"text": "hi"}), "a2a": ("echo", {"say": "hi"})}


class Instance(Protocol):
    url: str


async def started(protocol: str, tmp: Path, name: str) -> Instance:
    """A session-based MCP server (a connection closed under it shows as a new session) or an
    A2A agent, ready."""
    if protocol == "mcp":
        return await McpServerProcess(tmp, "session").start().ready()
    return await A2AAgentProcess(tmp, name).ready()


async def register(
    http: httpx.AsyncClient, gateway: GatewayProcess, protocol: str, url: str, capability: str
) -> str:
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={"protocol": protocol, "service_address": url, "capability": capability},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["instance_id"])


async def connections(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, protocol: str
) -> dict[str, int]:
    r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
    assert r.status_code == 200, r.text
    counts: dict[str, int] = r.json()["connections"].get(protocol, {})
    return counts


async def call(
    http: httpx.AsyncClient, gateway: GatewayProcess, protocol: str, capability: str
) -> dict[str, Any]:
    operation, payload = CALLS[protocol]
    r = await invoke(http, gateway, capability, operation, payload=payload)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def closed(gateway: GatewayProcess, instance_id: str) -> bool:
    """Whether the gateway's sweep closed the instance's connections (it says so in its log)."""
    return f"closing connections to {instance_id}: it left the registry" in gateway.proc.output()


@pytest.mark.parametrize("protocol", ["mcp", "a2a"])
async def test_a_live_instance_keeps_its_connections_and_one_that_left_loses_them(
    gateway: GatewayProcess, http: httpx.AsyncClient, tmp_path: Path, protocol: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    live_cap, gone_cap = f"live-{tag}", f"gone-{tag}"
    live, gone = await asyncio.gather(
        started(protocol, tmp_path, f"live-{tag}"), started(protocol, tmp_path, f"gone-{tag}")
    )
    # Both stop with the test (`tests.conftest`), whatever it ends in.
    live_id = await register(http, gateway, protocol, live.url, live_cap)
    gone_id = await register(http, gateway, protocol, gone.url, gone_cap)
    assert (await call(http, gateway, protocol, live_cap))["instance_id"] == live_id
    assert (await call(http, gateway, protocol, gone_cap))["instance_id"] == gone_id
    r = await http.delete(f"{gateway.url}/reach/agents/{gone_id}")
    assert r.status_code in (200, 204), r.text

    # Until the one that left is closed, by a sweep that also looked at the live one
    # (called before); or until the live one is closed, the failure this test is about.
    async def swept() -> bool:
        counts = await connections(http, gateway, gone_cap, protocol)
        return counts.get("reclaimed") == 1 or closed(gateway, live_id)

    await wait_until(swept, 20)
    assert not closed(gateway, live_id), "a live instance's connections were closed"
    assert closed(gateway, gone_id)
    assert (await connections(http, gateway, live_cap, protocol))["reclaimed"] == 0
    # The live one answers again, on what was kept.
    assert (await call(http, gateway, protocol, live_cap))["instance_id"] == live_id
    assert not closed(gateway, live_id)
    if isinstance(live, McpServerProcess):
        seen = (await live.seen())["seen"]
        # One session from the registration's discovery on: probes and both calls in it.
        assert [s["method"] for s in seen].count("initialize") == 1, seen
        sessions = {s["session"] for s in seen if s["method"] == "tools/call"}
        assert len(sessions) == 1, seen
        assert None not in sessions, seen
