"""Reach on Redis Sentinel: a master, its replica and three sentinels started by the test,
reached through `redis+sentinel://…/mymaster`, and failed over while in use.

What must hold across a failover: nothing accepted is lost (an invoke answered before or
after it succeeds; one refused in between is a retryable 503 that a client sending the same
RequestID again gets through, as docs/invoke.md says), and the registry refills (agents'
heartbeats reach the new master, or re-join where it lacks their record).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from reach.config import RegistrySettings
from reach.errors import Unavailable, UnknownInstance
from reach.policy.state import Bucket, create_policy_state
from reach.registry import HealthReport, JoinRequest, Registry
from reach.routing.inflight import SharedInflightTracker, create_inflight
from reach.security.tokens import SharedTokenStore, issue
from reach.store import create_store
from reach.store.redis import RedisStore
from reach.store.redis_connect import parse_redis_url
from tests.helpers import Agent, GatewayProcess, Stack, rid, wait_until
from tests.redis_servers import SentinelServers, redis_sentinel

pytestmark = pytest.mark.integration

SETTINGS = RegistrySettings(heartbeat_timeout=5, heartbeat_interval=1)


@pytest.fixture
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelServers]:
    """A topology per test: each one fails it over."""
    with redis_sentinel(tmp_path_factory.mktemp("redis-sentinel")) as servers:
        yield servers


@pytest.fixture
async def store(sentinel: SentinelServers) -> AsyncIterator[RedisStore]:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    s = create_store(RegistrySettings(type="redis", redis_url=sentinel.url, key_prefix=prefix))
    assert isinstance(s, RedisStore)
    try:
        yield s
    finally:
        await s.aclose()


def join(instance_id: str) -> JoinRequest:
    return JoinRequest(
        capability="retriever", instance_id=instance_id, service_address="127.0.0.1:9"
    )


async def served_by(store: RedisStore) -> int:
    """The port of the Redis the store's commands reach now."""
    info = await store.shared_redis().client.info("server")
    return int(info["tcp_port"])


async def test_the_store_follows_a_failover_without_a_refusal(
    sentinel: SentinelServers, store: RedisStore
) -> None:
    reg = Registry(store, SETTINGS)
    ids = [f"i{n}" for n in range(4)]
    for instance_id in ids:
        await reg.join(join(instance_id))
    state = create_policy_state(store)
    assert await state.claim("key", "mine", 60) == "mine"
    old = await served_by(store)
    assert old == sentinel.master_port()

    # Heartbeats all through the failover, as agents send them. The old master's pooled
    # connections fail (READONLY, or closed) and the one retry asks the sentinels again.
    failover = asyncio.get_running_loop().run_in_executor(None, sentinel.failover)
    refused: list[str] = []
    while not failover.done():
        for instance_id in ids:
            try:
                await reg.heartbeat(instance_id, HealthReport())
            except UnknownInstance:
                await reg.join(join(instance_id))  # a write the old master took, then lost
            except Unavailable as exc:
                refused.append(str(exc))
        await asyncio.sleep(0.02)
    new = await failover
    assert new != old

    # The sentinels have switched; the old master may take writes until they demote it, but
    # this process moves over within a second (it asks them), reads and writes alike.
    async def moved_over() -> bool:
        for instance_id in ids:
            try:
                await reg.heartbeat(instance_id, HealthReport())
            except UnknownInstance:
                await reg.join(join(instance_id))
        return await served_by(store) == new

    await wait_until(moved_over, timeout_s=3, every_s=0.05)
    assert refused == []  # a promoted replica answers at once: no caller saw the switch

    # Everything works on the new master: registry, breaker, buckets, claims, in-flight, tokens.
    assert [i.instance_id for i in await reg.instances("retriever")] == ids
    assert await state.peek("key") in ("mine", None)  # replicated, or lost with its window
    assert await state.take([Bucket(key="cap:r", per_minute=60, capacity=5)]) == 0
    tracker = create_inflight(store)
    assert isinstance(tracker, SharedInflightTracker)
    await tracker.start()
    try:
        call = tracker.begin("retriever", "i0")
        await tracker.flush()  # a script the promoted replica never loaded: NOSCRIPT, reloaded
        link = store.shared_redis()
        assert await link.client.zcard(link.key("inf:retriever")) == 1
        tracker.end(call)
        await tracker.flush()
    finally:
        await tracker.aclose()
    _, record = issue("ops", "admin")
    await SharedTokenStore(store).save(record)
    assert [r.id for r in await SharedTokenStore(store).load()] == [record.id]


@dataclass
class Load:
    """Invokes sent one after another by a few clients, each retried with its RequestID."""

    gateway: GatewayProcess
    capability: str
    done: list[dict[str, Any]] = field(default_factory=list)
    retried: dict[str, list[str]] = field(default_factory=dict)  # request id -> why
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, http: httpx.AsyncClient, *, keyed: bool) -> None:
        while not self.stop.is_set():
            body = {"target": self.capability, "operation": "query", "payload": {}}
            body["request_id"] = rid()
            if keyed:  # the workflow claims the key in Redis (retried by Temporal meanwhile)
                body["idempotency_key"] = f"key-{body['request_id']}"
            self.done.append(await self.until_answered(http, body))

    async def until_answered(self, http: httpx.AsyncClient, body: dict[str, Any]) -> Any:
        """What docs/invoke.md tells a client: a 503 (Retry-After), a 504 `running` or a lost
        connection is asked again with the same RequestID, which attaches to the request
        rather than starting another. Retry-After is shortened here to keep the test fast."""
        deadline = time.monotonic() + 45
        while True:
            try:
                r = await http.post(f"{self.gateway.url}/reach/invoke", json=body, timeout=10)
                if r.status_code not in (503, 504):
                    assert r.status_code == 200, r.text
                    return r.json()
                why = f"{r.status_code} {r.json()['error']['type']}"
            except httpx.TransportError as exc:
                why = type(exc).__name__
            self.retried.setdefault(str(body["request_id"]), []).append(why)
            assert time.monotonic() < deadline, f"{body['request_id']}: {self.retried}"
            await asyncio.sleep(0.1)


async def test_a_master_killed_mid_load_loses_no_invoke_and_the_registry_refills(
    sentinel: SentinelServers,
    temporal_server: str,
    tmp_path_factory: pytest.TempPathFactory,
    http: httpx.AsyncClient,
    capability: str,
) -> None:
    stack = Stack(
        temporal=temporal_server,
        tmp=tmp_path_factory.mktemp("sentinel-gw"),
        task_queue=f"tq-{uuid.uuid4().hex[:12]}",
        registry="redis",
        key_prefix=f"t-{uuid.uuid4().hex[:8]}",
        # Longer than the failover (about 2 s) with room for a busy machine: agents stay
        # registered through it, as they do with the production default of 30 s. (A record
        # that expires anyway is joined again: the first test shows that.)
        heartbeat_timeout=10.0,
        extra={
            "REACH_REGISTRY__REDIS_URL": sentinel.url,
            # A limit the load never reaches: every invoke takes a token from Redis at the door.
            "REACH_POLICY__CAPABILITIES": json.dumps(
                {capability: {"rate_limit": {"per_capability": {"per_minute": 600_000}}}}
            ),
        },
    )
    async with GatewayProcess(stack) as gw:
        agents = [Agent(gw, f"{capability}-{n}", capability) for n in range(2)]
        await asyncio.gather(*(a.ready() for a in agents))
        load = Load(gw, capability)
        clients = [asyncio.create_task(load.client(http, keyed=n % 2 == 0)) for n in range(4)]
        try:
            await wait_until(lambda: len(load.done) >= 10, timeout_s=30)
            old = sentinel.master_port()
            sentinel.node(old).kill()  # a crash: the sentinels notice, elect, promote
            killed_at = time.time()
            before = len(load.done)
            await asyncio.get_running_loop().run_in_executor(None, sentinel.wait_new_master, old)
            await wait_until(lambda: len(load.done) >= before + 10, timeout_s=30)
        finally:
            load.stop.set()
            await asyncio.gather(*clients)

        # The failover was mid-load: the door, taking its token from Redis, refused some.
        assert any("503 unavailable" in why for whys in load.retried.values() for why in whys)
        # Every invoke succeeded: answered at once, or after retries with its RequestID.
        assert {d["status"] for d in load.done} == {"success"}
        assert len({d["request_id"] for d in load.done}) == len(load.done)
        assert {d["instance_id"] for d in load.done} == {a.instance_id for a in agents}

        # The registry refilled on the new master: both agents listed, heard from since.
        async def refilled() -> bool:
            r = await http.get(f"{gw.url}/reach/capabilities/{capability}")
            if r.status_code != 200:
                return False
            seen = {i["instance_id"]: i["last_seen"] for i in r.json()["instances"]}
            return set(seen) == {a.instance_id for a in agents} and all(
                t > killed_at for t in seen.values()
            )

        await wait_until(refilled, timeout_s=20)
        with sentinel.node(sentinel.master_port()).client() as c:
            assert c.dbsize() > 0


def test_a_sentinel_url_names_the_sentinels_then_the_master() -> None:
    target = parse_redis_url(
        "redis+sentinel://:s3cret@10.0.0.1,10.0.0.2:26380,[::1]/prod-master/2"
        "?sentinel_password=other"
    )
    assert target.topology == "sentinel"
    assert target.hosts == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26379))
    assert (target.master, target.db, target.password) == ("prod-master", 2, "s3cret")
    assert target.sentinel_password == "other"
    with pytest.raises(ValueError, match="name the master") as err:
        parse_redis_url("redis+sentinel://:s3cret@10.0.0.1:26379")
    assert "s3cret" not in str(err.value)
    with pytest.raises(ValueError, match="scheme"):
        parse_redis_url("sentinel://10.0.0.1")
    assert parse_redis_url("rediss://h:6380/1").topology == "server"
