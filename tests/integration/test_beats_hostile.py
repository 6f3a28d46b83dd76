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
