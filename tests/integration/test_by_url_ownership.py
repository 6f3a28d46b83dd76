"""Who may replace or remove an instance registered by URL (issue 25), through a real gateway
with tokens on and a real A2A agent (a2a-sdk, its own process): one an admin registered, or
reach.yaml's `agents:`, is not an agent token's to overwrite, remove or take over by a Join,
even a token scoped to its capability; its own registrations are (docs/instances-by-url.md)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from reach.security.tokens import FileTokenStore, issue
from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import ROOT, GatewayProcess, wait_until

pytestmark = pytest.mark.integration

CAPABILITY = f"owned-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def a2a(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[A2AAgentProcess]:
    proc = A2AAgentProcess(tmp_path_factory.mktemp("a2a-owned"), "owned")
    try:
        yield await proc.ready()
    finally:
        proc.proc.stop()


@pytest.fixture(scope="module")
async def secured(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, a2a: A2AAgentProcess
) -> AsyncIterator[tuple[GatewayProcess, dict[str, str]]]:
    """A gateway holding tokens (so they are required): an admin, an agent token scoped to
    CAPABILITY; reach.yaml registers `yaml-1` of CAPABILITY."""
    tmp = tmp_path_factory.mktemp("owned")
    stack = new_stack(temporal_server, tmp)
    store = FileTokenStore(tmp / "tokens.json")
    tokens: dict[str, str] = {}
    for name, kind, caps in [("ops", "admin", []), ("worker", "agent", [CAPABILITY])]:
        token, record = issue(name, kind, caps)  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    static = [
        {"protocol": "a2a", "url": a2a.url, "capability": CAPABILITY, "instance_id": "yaml-1"}
    ]
    stack.extra["REACH_AGENTS"] = json.dumps(static)
    async with GatewayProcess(stack) as gw:
        yield gw, tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def register(
    http: httpx.AsyncClient, gw: GatewayProcess, token: str, instance_id: str, url: str
) -> httpx.Response:
    return await http.post(
        f"{gw.url}/reach/agents",
        json={
            "protocol": "a2a",
            "service_address": url,
            "capability": CAPABILITY,
            "instance_id": instance_id,
        },
        headers=bearer(token),
    )


async def instance(
    http: httpx.AsyncClient, gw: GatewayProcess, token: str, instance_id: str
) -> dict[str, Any] | None:
    r = await http.get(f"{gw.url}/reach/capabilities/{CAPABILITY}", headers=bearer(token))
    if r.status_code == 404:
        return None
    r.raise_for_status()
    found = [i for i in r.json()["instances"] if i["instance_id"] == instance_id]
    return found[0] if found else None


async def test_an_admins_registration_is_not_an_agent_tokens_to_replace_or_remove(
    secured: tuple[GatewayProcess, dict[str, str]], http: httpx.AsyncClient, a2a: A2AAgentProcess
) -> None:
    gw, tokens = secured
    r = await register(http, gw, tokens["ops"], "admin-1", a2a.url)
    assert r.status_code == 200, r.text
    # The same URL spelled otherwise: a re-registration that would point it elsewhere.
    other = a2a.url.replace("127.0.0.1", "localhost")
    r = await register(http, gw, tokens["worker"], "admin-1", other)
    assert r.status_code == 403, r.text
    assert "registered by an admin" in r.json()["error"]["message"]
    r = await http.delete(f"{gw.url}/reach/agents/admin-1", headers=bearer(tokens["worker"]))
    assert r.status_code == 403, r.text
    # Nor by joining its instance_id as an agent of its own.
    join = {
        "instance_id": "admin-1",
        "capability": CAPABILITY,
        "protocol": "http",
        "service_address": "127.0.0.1:9",
        "operations": [{"name": "echo"}],
    }
    r = await http.post(f"{gw.url}/reach/agents", json=join, headers=bearer(tokens["worker"]))
    assert r.status_code == 403, r.text
    held = await instance(http, gw, tokens["ops"], "admin-1")
    assert held is not None
    assert held["address"] == a2a.url, held
    # An admin may.
    r = await http.delete(f"{gw.url}/reach/agents/admin-1", headers=bearer(tokens["ops"]))
    assert r.status_code in (200, 204), r.text


async def test_a_configured_registration_is_the_configs_and_an_agents_own_is_its_own(
    secured: tuple[GatewayProcess, dict[str, str]], http: httpx.AsyncClient, a2a: A2AAgentProcess
) -> None:
    gw, tokens = secured

    async def joined() -> bool:
        return await instance(http, gw, tokens["ops"], "yaml-1") is not None

    await wait_until(joined, 15)
    r = await register(http, gw, tokens["worker"], "yaml-1", a2a.url)
    assert r.status_code == 403, r.text
    assert "reach.yaml" in r.json()["error"]["message"]
    r = await http.delete(f"{gw.url}/reach/agents/yaml-1", headers=bearer(tokens["worker"]))
    assert r.status_code == 403, r.text
    assert await instance(http, gw, tokens["ops"], "yaml-1") is not None
    # Its own: registered, registered again, removed.
    for _ in range(2):
        r = await register(http, gw, tokens["worker"], "mine-1", a2a.url)
        assert r.status_code == 200, r.text
    r = await http.delete(f"{gw.url}/reach/agents/mine-1", headers=bearer(tokens["worker"]))
    assert r.status_code in (200, 204), r.text


async def test_the_cli_says_an_agent_tokens_refusal_once(
    secured: tuple[GatewayProcess, dict[str, str]], a2a: A2AAgentProcess
) -> None:
    """`reach agents add` over an admin's registration printed `forbidden: forbidden: ...`."""
    gw, tokens = secured
    made = await register_via(gw, tokens["ops"], "admin-cli-1", a2a.url)
    assert made.returncode == 0, made.stderr
    refused = await register_via(gw, tokens["worker"], "admin-cli-1", a2a.url)
    assert refused.returncode == 1, refused.stdout
    [line] = refused.stderr.splitlines()
    assert line.startswith("error: forbidden: instance 'admin-cli-1' was registered by an admin")
    assert line.count("forbidden") == 1, line


async def register_via(
    gw: GatewayProcess, token: str, instance_id: str, url: str
) -> subprocess.CompletedProcess[str]:
    """`reach agents add a2a URL` with `token`, as its own process."""
    args = ["agents", "add", "a2a", url, "--capability", CAPABILITY, "--instance-id", instance_id]
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway_api", *args, "--gateway", gw.url, "--token", token],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "REACH_CONFIG": str(ROOT / "reach.yaml")},
    )
