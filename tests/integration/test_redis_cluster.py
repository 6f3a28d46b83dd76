"""Reach on a real Redis Cluster: three masters started by the test (`redis-server
--cluster-enabled`, `redis-cli --cluster create`), reached through `redis+cluster://`.

Every store, policy, in-flight and token operation runs through it — each multi-key script's
keys must share a slot or the cluster refuses it (CROSSSLOT) — pub/sub crosses nodes, and a
gateway on the cluster serves an invoke.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from reach.config import CircuitBreakerSettings, OutlierSettings, RegistrySettings
from reach.errors import UnknownInstance
from reach.policy.redis_state import RedisPolicyState
from reach.policy.state import Bucket, create_policy_state
from reach.registry import HealthReport, JoinRequest, Registry
from reach.registry.view import RegistryView
from reach.routing.inflight import SharedInflightTracker, create_inflight
from reach.security.tokens import SharedTokenStore, TokenCache, issue
from reach.store import create_store
from reach.store.redis import RedisStore
from reach.store.redis_connect import cluster_prefix
from tests.helpers import Agent, GatewayProcess, Stack, invoke, wait_until
from tests.redis_servers import RedisClusterServers, redis_cluster

pytestmark = pytest.mark.integration

SETTINGS = RegistrySettings(heartbeat_timeout=0.8, heartbeat_interval=0.2)
BREAKER = CircuitBreakerSettings(error_threshold=2, open_duration_ms=3_600_000)
OUTLIER = OutlierSettings(consecutive_failures=1, base_ejection_ms=3_600_000)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as servers:
        yield servers


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def store(cluster: RedisClusterServers, prefix: str) -> AsyncIterator[RedisStore]:
    s = create_store(RegistrySettings(type="redis", redis_url=cluster.url, key_prefix=prefix))
    assert isinstance(s, RedisStore)
    try:
        yield s
    finally:
        await s.aclose()


def join(instance_id: str, capability: str = "retriever") -> JoinRequest:
    return JoinRequest(
        capability=capability, instance_id=instance_id, service_address="127.0.0.1:9"
    )


def keys_by_node(cluster: RedisClusterServers, prefix: str) -> dict[int, list[str]]:
    """Every key of `prefix`, by the node (port) that holds it."""
    found: dict[int, list[str]] = {}
    for node in cluster.nodes:
        with node.client() as c:
            keys = [str(k) for k in c.scan_iter(match=f"{cluster_prefix(prefix)}*", count=500)]
        if keys:
            found[node.port] = keys
    return found


def slots_of(cluster: RedisClusterServers, keys: list[str]) -> set[int]:
    with cluster.nodes[0].client() as c:
        return {int(c.execute_command("CLUSTER", "KEYSLOT", key)) for key in keys}


async def test_the_registry_runs_whole_on_a_cluster(
    cluster: RedisClusterServers, store: RedisStore, prefix: str
) -> None:
    reg = Registry(store, SETTINGS)
    await asyncio.gather(*(reg.join(join(f"r{n}")) for n in range(6)))
    await reg.join(join("w0", "writer"))
    assert [i.instance_id for i in await reg.instances("retriever")] == [f"r{n}" for n in range(6)]
    assert sorted(await reg.capabilities()) == ["retriever", "writer"]
    # A move between groups: one script over the record, two indexes and the group list.
    await reg.join(join("r5", "writer"))
    assert [i.instance_id for i in await reg.instances("writer")] == ["r5", "w0"]
    # Heartbeats in one batch (a pipeline of EVALSHA), each with its own answer.
    reports = [HealthReport(status="ok", inflight=n) for n in range(5)]
    done = await asyncio.gather(*(reg.heartbeat(f"r{n}", reports[n]) for n in range(5)))
    assert [r.inflight for r in done] == list(range(5))
    assert [r.instance_id if r else None for r in await reg.get_many(["r0", "nope"])] == [
        "r0",
        None,
    ]
    assert await reg.leave("r0")
    with pytest.raises(UnknownInstance):
        await reg.heartbeat("r0", HealthReport())
    # Silence evicts: the record's key expires, the index is pruned when next read.
    await wait_until(lambda: _count(reg, "retriever", 0), timeout_s=5, every_s=0.1)
    await reg.sweep()
    assert await store.incr("rr:retriever") == 1
    # Every key of the deployment in one slot (so its scripts may touch any of them) — and
    # the cluster really is spread: the slot is one node's of three.
    by_node = keys_by_node(cluster, prefix)
    assert len(by_node) == 1
    assert len(slots_of(cluster, next(iter(by_node.values())))) == 1


async def _count(reg: Registry, capability: str, expected: int) -> bool:
    return len(await reg.instances(capability)) == expected


async def test_a_burst_waits_for_a_connection_rather_than_failing(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """redis-py's cluster nodes refuse a command past their pool at once; Reach's client makes
    it wait for one of `redis_max_connections`, as on one server."""
    # 4 + 16 (for subscriptions) connections a node: 100 at once would overflow the pool.
    small = RedisStore.from_url(cluster.url, prefix=prefix, max_connections=4, timeout_s=10)
    try:
        reg = Registry(small, RegistrySettings(heartbeat_timeout=60, heartbeat_interval=5))
        await reg.join(join("b000"))  # the capability exists before the burst joins it
        await asyncio.gather(*(reg.join(join(f"b{n:03d}")) for n in range(100)))
        state = create_policy_state(small)
        bucket = Bucket(key="cap:burst", per_minute=60_000, capacity=1000)
        waits = await asyncio.gather(*(state.take([bucket]) for _ in range(100)))
        assert waits == [0.0] * 100
        assert len(await reg.instances("retriever")) == 100
    finally:
        await small.aclose()


async def test_pubsub_reaches_a_view_through_another_client(
    cluster: RedisClusterServers, store: RedisStore, prefix: str
) -> None:
    """A second process's view follows joins made through the first (pub/sub on a cluster:
    the subscriber's connection may be to another node than the publisher's)."""
    other = RedisStore.from_url(cluster.url, prefix=prefix)
    view = RegistryView(Registry(other, SETTINGS), resync_s=3600, sweep_s=None)
    await view.start()
    try:
        await Registry(store, SETTINGS).join(join("seen"))

        async def has_it() -> bool:
            snapshot = view.cached("retriever")
            return snapshot is not None and "seen" in snapshot.by_id

        await wait_until(has_it, timeout_s=5)
    finally:
        await view.aclose()
        await other.aclose()


async def test_policy_state_breaker_outliers_buckets_and_claims(
    cluster: RedisClusterServers, store: RedisStore, prefix: str
) -> None:
    state = create_policy_state(store)
    assert isinstance(state, RedisPolicyState)
    # The breaker and the outliers: one script over both of the capability's keys.
    await state.record("cap", "a", False, BREAKER, OUTLIER)
    view = await state.record("cap", "a", False, BREAKER, OUTLIER)
    assert view.breaker.status == "open"
    assert "a" in view.ejected
    assert not (await state.admit("cap", BREAKER)).allowed
    # Rate buckets: several in one take, all or none.
    buckets = [Bucket(key="cap:x", per_minute=0.001, capacity=1), Bucket("caller:x:me", 0.001, 2)]
    assert await state.take(buckets) == 0
    assert await state.take(buckets) > 0  # the first is empty: nothing taken from the second
    left = await state.buckets(["cap:x", "caller:x:me"])
    assert left["cap:x"] < 1
    assert 0.99 < left["caller:x:me"] < 1.01
    # Idempotency claims.
    assert await state.claim("key-1", "mine", 30) == "mine"
    assert await state.claim("key-1", "theirs", 30) == "mine"
    assert await state.peek("key-1") == "mine"
    assert await state.release("key-1", "mine")
    assert await state.peek("key-1") is None
    assert len(keys_by_node(cluster, prefix)) == 1


async def test_inflight_counts_are_shared_through_the_cluster(
    cluster: RedisClusterServers, store: RedisStore, prefix: str
) -> None:
    other_store = RedisStore.from_url(cluster.url, prefix=prefix)
    mine, theirs = create_inflight(store), create_inflight(other_store)
    assert isinstance(mine, SharedInflightTracker)
    assert isinstance(theirs, SharedInflightTracker)
    await mine.start()
    await theirs.start()
    try:
        calls = [mine.begin("cap", "a"), mine.begin("cap", "a"), mine.begin("cap", "b")]
        await mine.flush()  # the cluster pipeline loads the lease script on its first NOSCRIPT
        await theirs.refresh("cap")
        assert theirs.counts("cap") == {"a": 2, "b": 1}
        for call in calls:
            mine.end(call)
        await mine.flush()
        await theirs.refresh("cap")
        assert theirs.counts("cap") == {}
    finally:
        await mine.aclose()
        await theirs.aclose()
        await other_store.aclose()


async def test_a_token_issued_through_one_client_is_seen_by_another(
    cluster: RedisClusterServers, store: RedisStore, prefix: str
) -> None:
    other = RedisStore.from_url(cluster.url, prefix=prefix)
    cache = TokenCache(SharedTokenStore(other), resync_s=3600)
    await cache.start()
    try:
        token, record = issue("ops", "admin")
        await SharedTokenStore(store).save(record)
        await wait_until(lambda: len(cache.book) == 1, timeout_s=5)
        assert cache.book.verify(token).name == "ops"
        await SharedTokenStore(store).revoke(record.id)
        await wait_until(lambda: cache.book.records[record.id].revoked_at is not None, 5)
    finally:
        await cache.aclose()
        await other.aclose()


async def test_a_gateway_on_the_cluster_serves_an_invoke(
    cluster: RedisClusterServers,
    temporal_server: str,
    tmp_path_factory: pytest.TempPathFactory,
    http: httpx.AsyncClient,
    capability: str,
    prefix: str,
) -> None:
    stack = Stack(
        temporal=temporal_server,
        tmp=tmp_path_factory.mktemp("cluster-gw"),
        task_queue=f"tq-{uuid.uuid4().hex[:12]}",
        registry="redis",
        key_prefix=prefix,
        extra={"REACH_REGISTRY__REDIS_URL": cluster.url},
    )
    async with GatewayProcess(stack) as gw:
        agent = await Agent(gw, f"{capability}-0", capability).ready()
        r = await invoke(http, gw, capability)
        assert r.status_code == 200, r.text
        assert r.json()["instance_id"] == agent.instance_id
        detail = await http.get(f"{gw.url}/reach/capabilities/{capability}")
        assert [i["instance_id"] for i in detail.json()["instances"]] == [agent.instance_id]
    assert len(keys_by_node(cluster, prefix)) == 1


def test_a_cluster_url_names_nodes_not_a_database() -> None:
    with pytest.raises(ValueError, match="only database 0"):
        RedisStore.from_url("redis+cluster://127.0.0.1:7000/2", prefix="x")
    # The keys' tag: added to a plain prefix, kept when the prefix has one.
    assert cluster_prefix("reach") == "{reach}"
    assert cluster_prefix("app:{reach}") == "app:{reach}"
    assert cluster_prefix("{}x") == "{{}x}"  # an empty `{}` is no tag: Redis hashes it all
