"""The background sweep runs the store only when it can find something (reach/registry/
sweeps.py), and still evicts a silent instance as soon after its expiry as a sweep every
tick did: on a real Redis, and on the memory store (which cannot say when records expire).
A quiet Redis subscription wakes once a spell, not once a round trip."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio.client import PubSub

from reach.config import RegistrySettings
from reach.registry import HealthReport, JoinRequest, Registry
from reach.registry.sweeps import SweepPlan
from reach.store import MemoryStore, Store
from reach.store.redis import RedisStore
from tests.redis_proxy import RedisProxy

pytestmark = pytest.mark.integration

TIMEOUT_S = 1.0
SETTINGS = RegistrySettings(heartbeat_timeout=TIMEOUT_S, heartbeat_interval=0.2)
TICK_S = 0.05


def join(instance_id: str, capability: str) -> JoinRequest:
    return JoinRequest(capability=capability, instance_id=instance_id, service_address="a:1")


@pytest.fixture
async def redis_store(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_url, prefix=redis_prefix)
    try:
        yield s
    finally:
        await s.aclose()


async def ticks_until_evicted(
    reg: Registry, plan: SweepPlan, evicted: list[str], instance_id: str, within_s: float
) -> float:
    """Sweep with `plan` every tick until `instance_id` is evicted; when (monotonic)."""
    deadline = time.monotonic() + within_s
    while instance_id not in evicted:
        assert time.monotonic() < deadline, f"{instance_id} not evicted within {within_s}s"
        await reg.sweep(plan)
        await asyncio.sleep(TICK_S)
    return time.monotonic()


async def test_redis_prunes_only_when_a_record_can_have_expired(redis_store: Store) -> None:
    reg = Registry(redis_store, SETTINGS)
    evicted: list[str] = []
    reg.on_evicted(lambda _capability, instance_id: evicted.append(instance_id))
    await reg.join(join("kept", "swept"))
    await reg.join(join("silent", "swept"))
    plan = SweepPlan(TIMEOUT_S)
    for _ in range(8):  # 0.4 s of ticks: every record has most of its TTL left
        await reg.sweep(plan)
        await asyncio.sleep(TICK_S)
    assert plan.pruned == 1
    # One instance goes silent; the other heartbeats: the silent one is evicted within a tick
    # or two of its expiry, and the heartbeating one never.
    silent_since = time.monotonic()
    deadline = silent_since + TIMEOUT_S + 1.0
    while "silent" not in evicted:
        assert time.monotonic() < deadline, "the silent instance was not evicted in time"
        await reg.heartbeat("kept", HealthReport())
        await reg.sweep(plan)
        await asyncio.sleep(TICK_S)
    assert time.monotonic() - silent_since >= TIMEOUT_S - 0.5  # not before its record expired
    assert evicted == ["silent"]
    assert [i.instance_id for i in await reg.instances("swept")] == ["kept"]
    assert plan.pruned < 12  # against ~25 ticks: a prune every tick before


async def test_a_capability_new_since_the_listing_is_swept_in_time(redis_store: Store) -> None:
    reg = Registry(redis_store, SETTINGS)
    evicted: list[str] = []
    reg.on_evicted(lambda _capability, instance_id: evicted.append(instance_id))
    plan = SweepPlan(TIMEOUT_S)
    await reg.sweep(plan)  # lists no capability
    await reg.join(join("late", "newcomer"))
    joined = time.monotonic()
    evicted_at = await ticks_until_evicted(reg, plan, evicted, "late", TIMEOUT_S + 1.0)
    assert evicted_at - joined >= TIMEOUT_S - 0.5


async def test_a_store_that_cannot_say_is_pruned_every_tick() -> None:
    store = MemoryStore()
    reg = Registry(store, SETTINGS)
    evicted: list[str] = []
    reg.on_evicted(lambda _capability, instance_id: evicted.append(instance_id))
    await reg.join(join("m", "memory"))
    plan = SweepPlan(TIMEOUT_S)
    for _ in range(3):
        await reg.sweep(plan)
    assert plan.pruned == 3
    await ticks_until_evicted(reg, plan, evicted, "m", TIMEOUT_S + 1.0)


async def test_a_quiet_subscription_pings_once_a_spell_and_still_hears(
    redis_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader waits out a whole quiet spell in one read; a None that comes at once (the
    # subscribe's confirmation, a ping's pong) must not start another ping: that spun the
    # loop at a ping per round trip.
    pings: list[float] = []
    real_ping = PubSub.ping

    def counting_ping(self: PubSub, message: object = None) -> Any:
        pings.append(time.monotonic())
        return real_ping(self, message)

    monkeypatch.setattr(PubSub, "ping", counting_ping)
    heard: list[str | None] = []
    subscription = await redis_store.subscribe("quiet", heard.append)
    subscription.PING_AFTER_S = 0.2  # type: ignore[attr-defined]  # its first read not yet made
    try:
        await asyncio.sleep(1.3)
        assert 3 <= len(pings) <= 9, f"{len(pings)} pings in 1.3 s, one per 0.2 s spell"
        await redis_store.publish("quiet", "still here")
        deadline = time.monotonic() + 5
        while "still here" not in heard:
            assert time.monotonic() < deadline, "the message after the quiet spell was lost"
            await asyncio.sleep(0.02)
        assert heard[0] is None  # told on (re)connecting that it may have missed some
        assert heard.count(None) == 1, "a live connection whose pings are answered was dropped"
    finally:
        await subscription.aclose()


class _SwallowsFirstPing(RedisProxy):
    """Holds the first PING it sees for good: that connection looks alive and never answers."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.swallowed = False

    async def admit(self, chunk: bytes) -> bool:
        if b"PING" in chunk and not self.swallowed:
            self.swallowed = True
            await asyncio.Event().wait()  # until the proxy closes
        return True


async def test_a_subscription_whose_ping_goes_unanswered_reconnects_and_hears_again(
    redis_url: str, redis_prefix: str
) -> None:
    """A connection that died silently (a frozen proxy, a half-open socket) answers no ping:
    the subscription must make a new one, not wait on the dead one for ever (revocations and
    policy changes would go unheard until the next resync)."""
    port = urlsplit(redis_url).port or 6379
    async with _SwallowsFirstPing(port) as proxy:
        store = RedisStore.from_url(proxy.url, prefix=redis_prefix)
        heard: list[str | None] = []
        subscription = await store.subscribe("frozen", heard.append)
        subscription.PING_AFTER_S = 0.3  # type: ignore[attr-defined]  # its first read not yet made
        try:
            deadline = time.monotonic() + 20
            while heard.count(None) < 2:  # told on connecting, and again on reconnecting
                assert time.monotonic() < deadline, (
                    f"no reconnect after an unanswered ping: {heard}"
                )
                await asyncio.sleep(0.05)
            assert proxy.swallowed
            while "after" not in heard:
                assert time.monotonic() < deadline, "the new connection heard nothing"
                await store.publish("frozen", "after")
                await asyncio.sleep(0.1)
        finally:
            await subscription.aclose()
            await store.aclose()
