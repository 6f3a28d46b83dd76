"""A worker running apart from its gateways (`python worker.py`) gives A2A agents a push config
pointing at `public_url` (REACH_PUBLIC_URL), never at a listen address that is a gateway's; with
none set it says so at start and sends no push config (the task is followed by polling).

Real processes: an API-only gateway (`--no-worker`) on the Redis registry, a separate
`worker.py` that runs the request, and an a2a-sdk agent that pushes and records the push URL
each task came with."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from reach.security.a2a_push import PUSH_PATH
from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, Stack, Worker, rid

pytestmark = pytest.mark.integration

CAP = "a2a-worker-push"
EXTRA = {"REACH_SECURITY__WEBHOOK_KEY": "test-worker-push-key"}
NO_URL = "A2A push notifications off in this worker: public_url (REACH_PUBLIC_URL) is not set"


@pytest.fixture(scope="module")
async def apart(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[tuple[Stack, GatewayProcess, A2AAgentProcess]]:
    tmp = tmp_path_factory.mktemp("a2a-worker-push")
    stack = new_stack(
        temporal_server, tmp, registry="redis", key_prefix=module_redis_prefix, extra=EXTRA
    )
    agent = A2AAgentProcess(tmp, "worker-pusher", push="on")
    try:
        async with GatewayProcess(stack, "api", worker=False) as gateway:
            await agent.ready()
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                r = await http.post(
                    f"{gateway.url}/reach/agents",
                    json={
                        "capability": CAP,
                        "instance_id": f"{CAP}-1",
                        "protocol": "a2a",
                        "service_address": agent.url,
                    },
                )
                assert r.status_code == 200, r.text
            yield stack, gateway, agent
    finally:
        agent.proc.stop()


async def _slow(http: httpx.AsyncClient, gateway: GatewayProcess) -> dict[str, Any]:
    request_id = rid()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={
            "request_id": request_id,
            "target": CAP,
            "operation": "slow",
            "payload": {"seconds": 1},
            "timeout_ms": 60_000,
        },
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["status"] == "success", body
    assert body["result"]["data"] == [{"done": True, "seconds": 1}]
    return body


async def test_a_worker_apart_sends_the_configured_public_url(
    apart: tuple[Stack, GatewayProcess, A2AAgentProcess], http: httpx.AsyncClient
) -> None:
    stack, gateway, agent = apart
    # Another name for the same gateway than its listen address, so the URL is provably this.
    public = f"http://localhost:{gateway.port}/"
    extra = {**stack.extra, "REACH_PUBLIC_URL": public}
    worker = await Worker(dataclasses.replace(stack, extra=extra)).ready()
    try:
        before = (await agent.counts())["counts"].get("pushed", 0)
        await _slow(http, gateway)
        seen = await agent.counts()
        assert NO_URL not in worker.proc.output()
    finally:
        worker.proc.stop()
    urls = list(seen["push_urls"].values())
    assert len(urls) == 1, seen
    assert urls[0].startswith(f"http://localhost:{gateway.port}{PUSH_PATH}/"), urls
    assert seen["counts"]["pushed"] > before  # and the agent's pushes were taken there


async def test_a_worker_apart_without_a_public_url_says_so_and_polls(
    apart: tuple[Stack, GatewayProcess, A2AAgentProcess], http: httpx.AsyncClient
) -> None:
    stack, gateway, agent = apart
    # The stack's listen port is not the gateway's (each gateway gets its own): a worker that
    # guessed from the listen address would send the agent to the wrong place.
    worker = await Worker(stack).ready()
    try:
        assert NO_URL in worker.proc.output()
        known = set((await agent.counts())["push_urls"])
        await _slow(http, gateway)
        seen = await agent.counts()
    finally:
        worker.proc.stop()
    assert set(seen["push_urls"]) == known, seen  # no push config came with the new task
