"""The registry and round robin over both store backends: memory and a real Redis."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from gateway_api.devserver import free_port
from reach.config import RegistrySettings
from reach.errors import Unavailable, UnknownInstance
from reach.registry import HealthReport, JoinRequest, Registry
from reach.routing import RoundRobin
from reach.store import MemoryStore, Store
from reach.store.redis import RedisStore

pytestmark = pytest.mark.integration

SETTINGS = RegistrySettings(heartbeat_timeout=0.6, heartbeat_interval=0.2)


def join(instance_id: str, capability: str = "retriever") -> JoinRequest:
    return JoinRequest(
        capability=capability, instance_id=instance_id, service_address=f"127.0.0.1:{9000}"
    )


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    prefix = request.getfixturevalue("redis_prefix")
    s = RedisStore.from_url(redis_url, prefix=prefix)
    try:
        yield s
    finally:
        await s.aclose()


async def test_join_heartbeat_health_and_leave(store: Store) -> None:
    reg = Registry(store, SETTINGS)
    await reg.join(join("a"))
    await reg.join(join("b"))
    assert [i.instance_id for i in await reg.instances("retriever")] == ["a", "b"]
    await reg.heartbeat("a", HealthReport(status="unhealthy", checks={"db": False}, inflight=3))
    a = await reg.get("a")
    assert a is not None
    assert (a.status, a.routable, a.inflight) == ("unhealthy", False, 3)
    assert await reg.leave("b")
    assert [i.instance_id for i in await reg.instances("retriever")] == ["a"]
    with pytest.raises(UnknownInstance):
        await reg.heartbeat("b", HealthReport())
    assert await reg.known("retriever")
    assert not await reg.known("writer")


async def test_silent_instance_expires_without_any_sweeper(store: Store) -> None:
    reg = Registry(store, SETTINGS)
    await reg.join(join("quiet"))
    await reg.join(join("chatty"))
    for _ in range(5):
        await asyncio.sleep(0.2)
        await reg.heartbeat("chatty", HealthReport())
    assert [i.instance_id for i in await reg.instances("retriever")] == ["chatty"]
    assert await reg.get("quiet") is None


async def test_rejoin_under_another_capability_moves_the_instance(store: Store) -> None:
    reg = Registry(store, SETTINGS)
    await reg.join(join("x", "retriever"))
    await reg.join(join("x", "generator"))
    assert await reg.instances("retriever") == []
    assert [i.instance_id for i in await reg.instances("generator")] == ["x"]


async def test_round_robin_counter_is_shared_by_all_routers(store: Store) -> None:
    reg = Registry(store, SETTINGS)
    for i in range(4):
        await reg.join(join(f"i{i}"))
    routers = [RoundRobin(store), RoundRobin(store)]  # e.g. two gateways
    candidates = await reg.instances("retriever")
    picks = await asyncio.gather(*(routers[n % 2].pick("retriever", candidates) for n in range(40)))
    assert Counter(p.instance_id for p in picks) == {f"i{i}": 10 for i in range(4)}


async def test_redis_outage_is_a_typed_retryable_error() -> None:
    dead = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="nowhere")
    try:
        with pytest.raises(Unavailable) as err:
            await Registry(dead, SETTINGS).join(join("a"))
        assert err.value.http_status == 503
        assert err.value.retryable
        assert "nowhere" in err.value.message
        assert await dead.ping() is False
    finally:
        await dead.aclose()
