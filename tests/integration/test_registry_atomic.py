"""Registry steps racing each other, as two gateways would: each step must be atomic.

On Redis every test drives two `Registry` objects over two separate `RedisStore` connections
and gathers the racing steps hundreds of times. On the memory store the same tests pin the
same semantics (one process, atomic by construction).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from reach.config import RegistrySettings
from reach.errors import UnknownInstance
from reach.registry import HealthReport, JoinRequest, Registry
from reach.store import MemoryStore, Store
from reach.store.redis import RedisStore

pytestmark = pytest.mark.integration

SETTINGS = RegistrySettings(heartbeat_timeout=30, heartbeat_interval=5)
# For records that must expire between two steps of a test.
FLEETING = RegistrySettings(heartbeat_timeout=0.05, heartbeat_interval=0.01)


@dataclass
class Pair:
    """Two gateways over the same registry data, each with its own store connection."""

    a: Registry
    b: Registry
    store: Store

    def fleeting(self) -> Registry:
        return Registry(self.store, FLEETING)


@pytest.fixture(params=["memory", "redis"])
async def pair(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Pair]:
    if request.param == "memory":
        store = MemoryStore()
        yield Pair(Registry(store, SETTINGS), Registry(store, SETTINGS), store)
        return
    prefix = request.getfixturevalue("redis_prefix")
    one = RedisStore.from_url(redis_url, prefix=prefix)
    two = RedisStore.from_url(redis_url, prefix=prefix)
    try:
        yield Pair(Registry(one, SETTINGS), Registry(two, SETTINGS), one)
    finally:
        await one.aclose()
        await two.aclose()


def join(instance_id: str, capability: str) -> JoinRequest:
    return JoinRequest(
        capability=capability, instance_id=instance_id, service_address="127.0.0.1:9000"
    )


async def listed(reg: Registry, capability: str) -> set[str]:
    return {r.instance_id for r in await reg.instances(capability)}


async def drop_from_index(store: Store, capability: str, instance_id: str) -> None:
    """Damage the index behind the registry's back (a lost write, a manual cleanup)."""
    if isinstance(store, MemoryStore):
        store._members[capability].discard(instance_id)
    else:
        assert isinstance(store, RedisStore)
        await store._r.srem(store._grp(capability), instance_id)


async def test_heartbeat_racing_leave_never_resurrects(pair: Pair, capability: str) -> None:
    for n in range(300):
        instance = f"i{n}"
        await pair.a.join(join(instance, capability))
        _, beat = await asyncio.gather(
            pair.a.leave(instance),
            pair.b.heartbeat(instance, HealthReport(inflight=n)),
            return_exceptions=True,
        )
        if isinstance(beat, BaseException):
            assert isinstance(beat, UnknownInstance), beat
        assert await pair.a.get(instance) is None, f"iteration {n}: left, then resurrected"
        with pytest.raises(UnknownInstance):
            await pair.b.heartbeat(instance, HealthReport())
        assert await pair.a.get(instance) is None
    assert await listed(pair.a, capability) == set()


async def test_sweep_racing_rejoin_keeps_the_rejoined(pair: Pair, capability: str) -> None:
    ids = [f"i{n}" for n in range(20)]
    fleeting = pair.fleeting()
    for round_ in range(25):
        for i in ids:
            await fleeting.join(join(i, capability))
        await asyncio.sleep(FLEETING.heartbeat_timeout + 0.02)  # expired, still indexed
        await asyncio.gather(pair.a.sweep(), *(pair.b.join(join(i, capability)) for i in ids))
        for i in ids:
            record = await pair.a.get(i)
            assert record is not None
            assert record.capability == capability
        assert await listed(pair.a, capability) == set(ids), f"round {round_}"
        for i in ids:
            await pair.a.leave(i)


async def test_move_racing_heartbeat_keeps_the_move(pair: Pair, capability: str) -> None:
    other = f"{capability}-other"
    for n in range(300):
        instance = f"i{n}"
        await pair.a.join(join(instance, capability))
        await asyncio.gather(
            pair.a.join(join(instance, other)),
            pair.b.heartbeat(instance, HealthReport(status="degraded")),
        )
        record = await pair.a.get(instance)
        assert record is not None
        assert record.capability == other, f"iteration {n}"
        assert instance in await listed(pair.a, other)
        assert instance not in await listed(pair.a, capability)
        await pair.a.leave(instance)


async def test_concurrent_moves_leave_the_instance_in_one_index(
    pair: Pair, capability: str
) -> None:
    caps = [f"{capability}-{n}" for n in range(3)]
    instance = "mover"
    for n in range(200):
        await asyncio.gather(
            pair.a.join(join(instance, caps[n % 3])),
            pair.b.join(join(instance, caps[(n + 1) % 3])),
        )
        record = await pair.a.get(instance)
        assert record is not None
        holders = [c for c in caps if instance in await listed(pair.a, c)]
        assert holders == [record.capability], f"iteration {n}"


async def test_heartbeat_repairs_the_index(pair: Pair, capability: str) -> None:
    await pair.a.join(join("x", capability))
    await drop_from_index(pair.store, capability, "x")
    assert await listed(pair.a, capability) == set()
    await pair.b.heartbeat("x", HealthReport())
    assert await listed(pair.a, capability) == {"x"}


async def test_heartbeat_keeps_the_join_part(pair: Pair, capability: str) -> None:
    await pair.a.join(join("x", capability))
    beat = await pair.b.heartbeat("x", HealthReport(status="degraded", checks={"db": 1}))
    stored = await pair.a.get("x")
    assert stored is not None
    assert (beat.capability, beat.status, beat.heartbeat_interval) == (
        stored.capability,
        stored.status,
        stored.heartbeat_interval,
    )
    assert (stored.status, stored.checks, stored.address) == (
        "degraded",
        {"db": 1},
        "127.0.0.1:9000",
    )
