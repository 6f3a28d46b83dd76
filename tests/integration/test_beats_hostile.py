"""A hostile agent's batched heartbeats (issue 25): one POST /reach/heartbeats may not make a
gateway announce one instance's change once per entry. A real gateway on a real Redis under the
module's own key prefix, the announcements counted on that Redis's registry channel."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import issue_cli

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[GatewayProcess]:
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("hostile-beats"),
        registry="redis",
        key_prefix=module_redis_prefix,
        heartbeat_timeout=30.0,
    )
    async with GatewayProcess(stack) as gw:
        yield gw


async def test_a_batch_flipping_one_instance_announces_it_once(
    gateway: GatewayProcess, http: httpx.AsyncClient, redis_url: str, module_redis_prefix: str
) -> None:
    """1000 entries for one instance, its status flipping entry by entry: every entry is
    answered, and the change is announced once for the batch (it was announced 1000 times,
    each a Redis round trip in turn and a refresh on every gateway subscribed)."""
    capability = f"flip-{uuid.uuid4().hex[:8]}"
    instance = f"{capability}-0"
    join = {"instance_id": instance, "capability": capability, "service_address": "127.0.0.1:9"}
    r = await http.post(f"{gateway.url}/reach/agents", json=join)
    assert r.status_code == 200, r.text

    client = aioredis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    await pubsub.psubscribe(f"{module_redis_prefix}*registry*")
    heard: list[str] = []

    async def listen() -> None:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                heard.append(message["data"].decode())

    listening = asyncio.create_task(listen())
    try:
        statuses = ["unhealthy", "ok"] * 500
        body = [{"instance_id": instance, "status": s} for s in statuses]
        r = await http.post(f"{gateway.url}/reach/heartbeats", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (answer["recorded"], answer["refused"]) == (1000, 0)
        assert [x["status"] for x in answer["results"]] == statuses
        # A marker after the batch: once it is heard, everything the batch announced was.
        marker = f"{capability}-marker"
        r = await http.post(f"{gateway.url}/reach/agents", json={**join, "instance_id": marker})
        assert r.status_code == 200, r.text
        await wait_until(lambda: any(marker in h for h in heard), 10)
        mine = [h for h in heard if h == f"{capability}\t{instance}"]
        assert len(mine) <= 1, f"announced {len(mine)} times for one batch"
    finally:
        listening.cancel()
        await pubsub.aclose()
        await client.aclose()


@pytest.fixture(scope="module")
async def secured(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[tuple[GatewayProcess, dict[str, str]]]:
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("hostile-beats-s"),
        registry="redis",
        key_prefix=f"{module_redis_prefix}-s",
        heartbeat_timeout=30.0,
        extra={"REACH_AUTH__MODE": "tokens"},
    )
    tokens = {
        name: issue_cli(stack, "--principal", name, "--agent", "--capability", "*")[0]
        for name in ("owner", "intruder")
    }
    async with GatewayProcess(stack, "secured") as gw:
        yield gw, tokens


async def test_an_unreadable_record_is_not_beaten_by_a_token_that_cannot_be_checked(
    secured: tuple[GatewayProcess, dict[str, str]],
    http: httpx.AsyncClient,
    redis_url: str,
    module_redis_prefix: str,
) -> None:
    """A record whose brief cannot be read (written by another version, or damaged) cannot
    show who registered it: an agent token's heartbeat for it was let through to the write
    (the check failed open), refreshing it and writing the intruder's health into it."""
    gateway, tokens = secured
    capability = f"unread-{uuid.uuid4().hex[:8]}"
    instance = f"{capability}-0"
    join = {"instance_id": instance, "capability": capability, "service_address": "127.0.0.1:9"}
    owner = {"Authorization": f"Bearer {tokens['owner']}"}
    r = await http.post(f"{gateway.url}/reach/agents", json=join, headers=owner)
    assert r.status_code == 200, r.text
    client = aioredis.Redis.from_url(redis_url)
    try:
        key = f"{module_redis_prefix}-s:rec:{instance}"
        fields = await client.hgetall(key)
        assert b"brief" in fields, fields
        await client.hset(key, "brief", "{damaged")
        intruder = {"Authorization": f"Bearer {tokens['intruder']}"}
        body = [{"instance_id": instance, "status": "unhealthy"}]
        r = await http.post(f"{gateway.url}/reach/heartbeats", json=body, headers=intruder)
        assert r.status_code == 200, r.text
        [result] = r.json()["results"]
        assert (result["error"] or {}).get("type") == "forbidden", result
        health = await client.hget(key, "health")
        assert health is not None
        assert b"unhealthy" not in health, health
    finally:
        await client.aclose()
