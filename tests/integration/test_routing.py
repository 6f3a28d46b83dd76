"""Routing (issue 8), counted where the calls land: weighted shares, least request across
gateways, in-flight leases of a killed worker, consistent hashing with bounded load, the
max_inflight and health bypass, and how fresh each process's registry view is.

Real gateway and worker processes over a real Temporal dev server and Redis (a key prefix per
test). The agents are in-process HTTP servers (the SDK's `HttpAgentServer`) that join over the
gateway's HTTP API, heartbeat with a status the test sets, count every call and can hold calls
until released: where a request went is read from both the agent and the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_sdk.wire import Answer, Inbound
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, Stack, Worker, agent_server, invoke, rid, wait_until

pytestmark = pytest.mark.integration

# A deadline no slow machine reaches, where a test is not about deadlines.
DEADLINE_MS = 20_000

# Calls at once where a test's routing does not depend on what is in flight.
CONCURRENT = 8
HOLD_MAX_S = 60.0  # a held call is released by the test; this only bounds a broken one


class Instance:
    """One agent instance: an HTTP server in this process, joined and heartbeating over HTTP."""

    def __init__(
        self,
        gateway: GatewayProcess,
        capability: str,
        instance_id: str,
        *,
        weight: int | None = None,
        max_inflight: int | None = None,
    ) -> None:
        self.gateway = gateway
        self.capability = capability
        self.instance_id = instance_id
        self.weight = weight
        self.max_inflight = max_inflight
        self.status = "ok"
        self.delay_s = 0.0  # every call takes this long
        self.calls: list[str] = []  # request ids, in arrival order
        self.active = 0  # calls being served now
        self.joins = 0
        self._holding = False
        self._released = asyncio.Event()
        self._server = agent_server(self._handle)
        self._beats: asyncio.Task[None] | None = None
        self._http = httpx.AsyncClient(trust_env=False, timeout=10)

    async def _handle(self, request: Inbound) -> Answer:
        request_id = request.headers.get("x-reach-request-id", "")
        self.calls.append(request_id)
        self.active += 1
        try:
            if self._holding:
                await asyncio.wait_for(self._released.wait(), HOLD_MAX_S)
            elif self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        return Answer(200, {"instance_id": self.instance_id, "request_id": request_id})

    def hold(self) -> None:
        """Calls from now on wait until `release`."""
        self._released.clear()
        self._holding = True

    def release(self) -> None:
        self._holding = False
        self._released.set()

    async def start(self) -> Instance:
        await self._server.start()
        await self.join()
        self._beats = asyncio.create_task(self._beat())
        return self

    async def join(self) -> None:
        body: dict[str, Any] = {
            "capability": self.capability,
            "instance_id": self.instance_id,
            "service_address": f"127.0.0.1:{self._server.port}",
            "heartbeat_interval": 0.5,
            "operations": [{"name": "query", "idempotent": True}],
        }
        if self.weight is not None:
            body["weight"] = self.weight
        if self.max_inflight is not None:
            body["max_inflight"] = self.max_inflight
        r = await self._http.post(f"{self.gateway.url}/reach/agents", json=body)
        assert r.status_code == 200, r.text
        self.joins += 1

    async def heartbeat(self, status: str | None = None) -> None:
        """Report `status` (kept for the following heartbeats) now."""
        if status is not None:
            self.status = status
        r = await self._http.put(
            f"{self.gateway.url}/reach/agents/{self.instance_id}/heartbeat",
            json={"status": self.status},
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] == self.status

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.4)
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                await self.heartbeat()

    def silence(self) -> None:
        """Stop heartbeating (still serving): the registry evicts it after heartbeat_timeout."""
        if self._beats is not None:
            self._beats.cancel()

    async def leave(self) -> None:
        self.silence()
        r = await self._http.delete(f"{self.gateway.url}/reach/agents/{self.instance_id}")
        assert r.status_code == 204, r.text

    async def aclose(self) -> None:
        self.silence()
        self.release()
        await self._server.close()
        await self._http.aclose()


@pytest.fixture
async def instances() -> AsyncIterator[Callable[..., Awaitable[list[Instance]]]]:
    """`await instances(gateway, capability, ids, **join_fields)`: started, closed at the end."""
    started: list[Instance] = []

    async def start(
        gateway: GatewayProcess, capability: str, ids: Sequence[str], **fields: Any
    ) -> list[Instance]:
        made = [Instance(gateway, capability, i, **fields) for i in ids]
        started.extend(made)
        await asyncio.gather(*(m.start() for m in made))
        return made

    yield start
    await asyncio.gather(*(i.aclose() for i in started), return_exceptions=True)


async def _settled(call: asyncio.Task[str], holder: Instance) -> bool:
    """The call finished, or is being held by `holder`."""
    return call.done() or holder.active > 0


def name(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


def stacks(temporal: str, tmp: Path, prefix: str, count: int, extra: dict[str, str]) -> list[Stack]:
    """`count` stacks sharing one Redis registry (`prefix`), each with its own task queue."""
    return [
        new_stack(
            temporal,
            tmp,
            registry="redis",
            key_prefix=prefix,
            heartbeat_timeout=3.0,
            extra=dict(extra),
        )
        for _ in range(count)
    ]


async def gateways(*stack_list: Stack) -> list[GatewayProcess]:
    made = [GatewayProcess(s, f"gateway{i}") for i, s in enumerate(stack_list)]
    await asyncio.gather(*(g.ready() for g in made))
    return made


def routing_config(**capabilities: dict[str, Any]) -> dict[str, str]:
    """`capabilities.<name>` sections as the REACH_CAPABILITIES environment override."""
    return {"REACH_CAPABILITIES": json.dumps(capabilities)}


# The capabilities of the tests that share one pair of gateways (`pair`), each with the routing
# its test asks for: one pair per module, where each test used to start one or two of its own.
WRR_JOIN, WRR_CONF = name("wrr-join"), name("wrr-conf")
LR, CH, CH_USER, HOT = name("lr"), name("ch"), name("ch-user"), name("hot")
FULL, FULL_CONF, HEALTH = name("full"), name("full-conf"), name("health")
JOIN_LIMIT, STALE, NEVER_CALLS = name("join-limit"), name("stale"), name("never-calls")
WRR = {"strategy": "weighted_round_robin"}
# Bounded load set loose: at this load its capacity would be 1 call per instance, so one
# in-flight count of the other gateway's, read a moment late, would rightly spill a key
# (test 5 is about that); there, the ring alone decides.
LOOSE_RING = {"strategy": "consistent_hash", "balance_factor": 100}
SHARED_ROUTES: dict[str, dict[str, Any]] = {
    WRR_JOIN: {"routing": WRR},
    # Configuration wins over what the instances say at Join (here: the reverse).
    WRR_CONF: {"routing": {**WRR, "weights": {f"{WRR_CONF}-heavy": 3, f"{WRR_CONF}-light": 1}}},
    LR: {"routing": {"strategy": "least_request"}},
    CH: {"routing": LOOSE_RING},
    CH_USER: {"routing": {**LOOSE_RING, "hash_on": "payload.user_id"}},
    HOT: {"routing": {"strategy": "consistent_hash", "balance_factor": 1.0}},
    # A configured ceiling far above the Join's 1: the smaller holds.
    FULL: {"routing": {"max_inflight": 1000}},
    FULL_CONF: {"routing": {"max_inflight": 1}},
    STALE: {"routing": {"max_inflight": 1}},
    NEVER_CALLS: {"routing": {"strategy": "least_request", "max_inflight": 1}},
}


@pytest.fixture(scope="module")
async def pair(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways on one Redis registry (`module_redis_prefix`), each with its own task
    queue, routing the SHARED_ROUTES capabilities; each test uses capabilities of its own."""
    tmp = tmp_path_factory.mktemp("routing")
    sa, sb = stacks(temporal_server, tmp, module_redis_prefix, 2, routing_config(**SHARED_ROUTES))
    a, b = await gateways(sa, sb)
    try:
        yield a, b
    finally:
        a.proc.stop()
        b.proc.stop()


async def served_by(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, **body: Any
) -> str:
    """The instance that served one successful request."""
    r = await invoke(http, gateway, capability, **{"timeout_ms": DEADLINE_MS, **body})
    assert r.status_code == 200, r.text
    instance_id = r.json()["instance_id"]
    assert isinstance(instance_id, str)
    return instance_id


async def each(count: int, concurrency: int, one: Callable[[int], Awaitable[str]]) -> list[str]:
    """Run `one(i)` for i < count, `concurrency` at a time; the instances returned, in order."""
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> str:
        async with gate:
            return await one(i)

    return list(await asyncio.gather(*(run(i) for i in range(count))))


async def spread(
    count: int, concurrency: int, one: Callable[[int], Awaitable[str]]
) -> Counter[str]:
    """Run `one(i)` for i < count, `concurrency` at a time; count the instances returned."""
    return Counter(await each(count, concurrency, one))


# -- 1. weighted round robin -------------------------------------------------------------------


async def test_weighted_round_robin_shares_follow_join_weights_or_configured_ones(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    by_join, by_config = WRR_JOIN, WRR_CONF  # configured 3:1, the reverse of their Joins
    heavy, light = f"{by_config}-heavy", f"{by_config}-light"
    gw, _ = pair
    await instances(gw, by_join, [f"{by_join}-heavy"], weight=3)
    await instances(gw, by_join, [f"{by_join}-light"], weight=1)
    await instances(gw, by_config, [heavy], weight=1)
    await instances(gw, by_config, [light], weight=3)

    async def one(capability: str) -> Callable[[int], Awaitable[str]]:
        async def call(_: int) -> str:
            return await served_by(http, gw, capability)

        return call

    shares = await spread(400, 8, await one(by_join))
    print("weights from Join 3:1 ->", dict(shares))
    assert sum(shares.values()) == 400
    assert abs(shares[f"{by_join}-heavy"] - 300) <= 20, shares
    assert abs(shares[f"{by_join}-light"] - 100) <= 20, shares

    shares = await spread(120, 8, await one(by_config))
    print("configured weights 3:1 over Join's 1:3 ->", dict(shares))
    assert abs(shares[heavy] - 90) <= 12, shares
    assert abs(shares[light] - 30) <= 12, shares


# -- 2. least request across gateways -----------------------------------------------------------


async def test_least_request_passes_over_the_slow_instance_from_both_gateways(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    capability = LR
    a, b = pair
    slow, *fast = await instances(
        a, capability, [f"{capability}-slow", f"{capability}-fast1", f"{capability}-fast2"]
    )
    slow.delay_s = 4.0
    await asyncio.sleep(0.5)  # B's view has the three (test 7 measures how fast)

    async def one(i: int) -> str:
        return await served_by(http, (a, b)[i % 2], capability)

    # Two clients per gateway, 60 requests: round robin would send the slow instance 20 (and
    # keep a client waiting 4 s each time); least request sends it only its first few, then
    # sees it holding them (its own calls and, from Redis, the other gateway's) and routes
    # every later request to an idle fast instance.
    started = time.monotonic()
    shares = await spread(60, 4, one)
    took = time.monotonic() - started
    print(f"least request over 2 gateways in {took:.1f}s:", dict(shares))
    assert sum(shares.values()) == 60
    assert shares[slow.instance_id] == len(slow.calls) <= 6, shares
    # The rest went to the fast ones (split by their recent latency, peak EWMA: not evenly).
    assert sum(shares[f.instance_id] for f in fast) == 60 - shares[slow.instance_id] >= 54


# -- 3. in-flight leases of a killed process ---------------------------------------------------


async def test_a_killed_workers_inflight_counts_expire_after_the_lease(
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    redis_url: str,
    http: httpx.AsyncClient,
    instances: Any,
) -> None:
    import redis.asyncio as aioredis

    capability = name("lease")
    lease_s = 2.0
    [stack] = stacks(
        temporal_server,
        tmp_path,
        redis_prefix,
        1,
        {
            **routing_config(
                **{capability: {"mode": "queue", "routing": {"strategy": "least_request"}}}
            ),
            "REACH_ROUTING__INFLIGHT_LEASE_S": str(lease_s),
        },
    )
    [gw] = await gateways(stack)
    worker = Worker(stack, "--capability", capability)
    await worker.ready()
    [agent] = await instances(gw, capability, [f"{capability}-01"])
    agent.hold()
    calls = [
        asyncio.create_task(invoke(http, gw, capability, timeout_ms=DEADLINE_MS)) for _ in range(3)
    ]
    key = f"{redis_prefix}:inf:{capability}"
    r = aioredis.Redis.from_url(redis_url)
    try:

        async def now_ms() -> int:
            sec, usec = await r.time()
            return int(sec) * 1000 + int(usec) // 1000

        async def live() -> int:
            return int(await r.zcount(key, f"({await now_ms()}", "+inf"))

        async def three_held() -> bool:
            return agent.active == 3 and await live() == 3

        await wait_until(three_held, 20)
        members = [m.decode() for m in await r.zrange(key, 0, -1)]
        # <instance>\x1f<process: host:pid:token>\x1f<seq>, written by the worker (which
        # called the agent), not by the gateway.
        owners = {tuple(m.split("\x1f")[:2]) for m in members}
        assert len(owners) == 1, members
        [(instance_id, process)] = owners
        assert instance_id == agent.instance_id
        assert process.rsplit(":", 2)[1] == str(worker.proc.popen.pid), process

        worker.proc.kill()
        worker.proc.popen.wait(10)
        killed_ms = await now_ms()
        killed = time.monotonic()
        # Nothing removed them: they are still there, each lease ending within lease_s of
        # its last renewal, which came before the kill.
        scores = [score for _, score in await r.zrange(key, 0, -1, withscores=True)]
        assert len(scores) == 3
        assert max(scores) <= killed_ms + lease_s * 1000 + 50, (scores, killed_ms)

        async def expired() -> bool:
            return await live() == 0

        took = await wait_until(expired, lease_s + 8, every_s=0.1)
        print(f"in-flight counts of the killed worker expired {took:.2f}s after the kill")
        assert time.monotonic() - killed <= lease_s + 8
    finally:
        await r.aclose()
        # Their workflows wait for a worker that is gone: the gateway would wait for them.
        gw.proc.kill()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


# -- 4. consistent hashing ----------------------------------------------------------------------


async def resolved(temporal: str, request_id: str) -> dict[str, Any]:
    """Attempt 1's Endpoint as the request's workflow history has it: chosen at the door (in
    the workflow's input), or by the resolve activity (its result)."""
    from temporalio.client import Client

    client = await Client.connect(temporal)
    history = await client.get_workflow_handle(request_id).fetch_history()
    results = []
    for event in history.events:
        # Resolve runs as a local activity (a marker) or a regular one, by mode.
        if event.HasField("workflow_execution_started_event_attributes"):
            inp = event.workflow_execution_started_event_attributes.input.payloads[0]
            if json.loads(inp.data).get("endpoint"):
                results.append(json.loads(inp.data)["endpoint"])
            continue
        if event.HasField("marker_recorded_event_attributes"):
            details = event.marker_recorded_event_attributes.details
            payloads = details["result"].payloads if "result" in details else []
        elif event.HasField("activity_task_completed_event_attributes"):
            payloads = event.activity_task_completed_event_attributes.result.payloads
        else:
            continue
        for payload in payloads:
            value = json.loads(payload.data)
            if isinstance(value, dict) and "route_note" in value:
                results.append(value)
    assert len(results) == 1, results
    return results[0]


async def test_consistent_hash_keeps_keys_on_their_instance_across_gateways(
    temporal_server: str,
    pair: tuple[GatewayProcess, GatewayProcess],
    http: httpx.AsyncClient,
    instances: Any,
) -> None:
    by_key, by_user = CH, CH_USER  # a loose ring: the ring alone decides
    a, b = pair
    ring = await instances(a, by_key, [f"{by_key}-{i:02d}" for i in range(10)])
    users_ring = await instances(b, by_user, [f"{by_user}-{i}" for i in range(4)])

    async def routes_to_exactly(gateway: GatewayProcess, capability: str, ids: set[str]) -> bool:
        """Without a hash key round robin routes: twice round reaches exactly the instances in
        the gateway's view."""
        seen = await each(2 * len(ids), CONCURRENT, lambda _: served_by(http, gateway, capability))
        return set(seen) == ids

    async def views_hold(capability: str, ids: set[str]) -> None:
        """Until both gateways' views hold exactly `ids` (test 7 measures how fast)."""
        for gateway in (a, b):
            await wait_until(partial(routes_to_exactly, gateway, capability, ids), 20)

    await views_hold(by_key, {i.instance_id for i in ring})
    await views_hold(by_user, {i.instance_id for i in users_ring})

    # The ring decides alone (no spill at this load), so calls go CONCURRENT at a time: what a
    # key is sent to does not depend on what else is in flight.
    # One key, 100 calls, alternating gateways: one instance.
    homes = await spread(
        100, CONCURRENT, lambda i: served_by(http, (a, b)[i % 2], by_key, routing_key="user-42")
    )
    assert len(homes) == 1, homes

    keys = [f"key-{i}" for i in range(24)]

    async def homes_on(gateway: GatewayProcess) -> dict[str, str]:
        got = await each(
            len(keys), CONCURRENT, lambda i: served_by(http, gateway, by_key, routing_key=keys[i])
        )
        return dict(zip(keys, got, strict=True))

    on_a, on_b = await homes_on(a), await homes_on(b)
    assert on_a == on_b
    assert len(set(on_a.values())) >= 5, Counter(on_a.values())  # spread over the ring

    # The payload field decides, whatever the routing_key says.
    same_user = await spread(
        8,
        CONCURRENT,
        lambda i: served_by(
            http, (a, b)[i % 2], by_user, payload={"user_id": "u-7"}, routing_key=f"r-{i}"
        ),
    )
    assert len(same_user) == 1, same_user
    users = await spread(
        12,
        CONCURRENT,
        lambda i: served_by(
            http, (a, b)[i % 2], by_user, payload={"user_id": f"u-{i}"}, routing_key="r-0"
        ),
    )
    assert len(users) >= 2, users

    # One of 10 leaves: only its keys move.
    victim = Counter(on_a.values()).most_common(1)[0][0]
    await next(i for i in ring if i.instance_id == victim).leave()
    await views_hold(by_key, {i.instance_id for i in ring} - {victim})
    moved_to = await each(
        len(keys),
        CONCURRENT,
        lambda i: served_by(http, (a, b)[i % 2], by_key, routing_key=keys[i]),
    )
    after = dict(zip(keys, moved_to, strict=True))
    moved = {k for k in keys if after[k] != on_a[k]}
    assert moved == {k for k in keys if on_a[k] == victim}, (moved, on_a, after)
    assert victim not in after.values()

    # No key: the fallback routes it, and the request's history and the log say so.
    request_id = rid()
    await served_by(http, a, by_key, request_id=request_id)
    note = "no hash key (routing_key): routed by round_robin"
    endpoint = await resolved(temporal_server, request_id)
    assert (endpoint["strategy"], endpoint["route_note"]) == ("round_robin", note), endpoint
    line = next(ln for ln in a.proc.output().splitlines() if f"request={request_id}" in ln)
    assert line.endswith(f"by round_robin; {note}"), line


# -- 5. bounded load ----------------------------------------------------------------------------


async def test_bounded_load_spills_a_hot_key_while_its_home_is_full(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    capability = HOT  # consistent hash, balance_factor 1.0
    gw, _ = pair
    fleet = await instances(gw, capability, [f"{capability}-{i}" for i in range(4)])
    by_id = {i.instance_id: i for i in fleet}
    home = by_id[await served_by(http, gw, capability, routing_key="hot")]
    home.hold()

    # 8 at once, one key: the home takes what its capacity allows (1.0 x the mean load, at
    # least 1), the rest go on clockwise round the ring.
    calls = [
        asyncio.create_task(served_by(http, gw, capability, routing_key="hot")) for _ in range(8)
    ]

    async def settled() -> bool:
        done = sum(c.done() for c in calls)
        return home.active >= 1 and done + home.active == len(calls)

    await wait_until(settled, 20)
    held = home.active
    spilled = Counter(c.result() for c in calls if c.done())
    print(f"hot key: {held} held at its home, spilled {dict(spilled)}")
    assert 1 <= held <= 2, (held, spilled)  # capacity: ceil(1.0 * 8 / 4) at most
    assert home.instance_id not in spilled
    assert sum(spilled.values()) == 8 - held

    home.release()
    assert Counter(await asyncio.gather(*calls))[home.instance_id] == held
    # The spill lasted as long as the load: the key is home again.
    assert await served_by(http, gw, capability, routing_key="hot") == home.instance_id


# -- 6. the bypass: max_inflight and health -----------------------------------------------------


async def test_full_degraded_and_unhealthy_instances_are_passed_over(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    # FULL: a configured ceiling far above the Join's 1 (the smaller holds); FULL_CONF: 1.
    by_join, by_config, health = FULL, FULL_CONF, HEALTH
    gw, _ = pair

    # max_inflight from Join (the smaller limit holds): the full instance gets nothing until
    # it drains.
    [small] = await instances(gw, by_join, [f"{by_join}-small"], max_inflight=1)
    [big] = await instances(gw, by_join, [f"{by_join}-big"])
    small.hold()
    first: list[asyncio.Task[str]] = []
    while not small.active:  # round robin: the first or the second request fills it
        assert len(first) < 4, small.calls
        first.append(asyncio.create_task(served_by(http, gw, by_join)))
        await wait_until(lambda: _settled(first[-1], small), 20, every_s=0.02)
    while_full = Counter([await served_by(http, gw, by_join) for _ in range(8)])
    assert while_full == {big.instance_id: 8}, while_full
    assert len(small.calls) == 1
    small.release()
    await asyncio.gather(*first)
    drained = Counter([await served_by(http, gw, by_join) for _ in range(8)])
    assert drained[small.instance_id] >= 3, drained

    # max_inflight from configuration; every instance full is a retryable 503 no_instance.
    both = await instances(gw, by_config, [f"{by_config}-1", f"{by_config}-2"])
    for i in both:
        i.hold()
    held = [asyncio.create_task(served_by(http, gw, by_config)) for _ in range(2)]

    async def both_full() -> bool:
        return all(i.active == 1 for i in both)

    await wait_until(both_full, 20)
    r = await invoke(http, gw, by_config, timeout_ms=3000)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (error["type"], error["retryable"]) == ("no_instance", True), error
    assert "max_inflight" in error["message"], error
    for i in both:
        i.release()
    assert sorted(await asyncio.gather(*held)) == [i.instance_id for i in both]
    assert sum(len(i.calls) for i in both) == 2  # the refused one reached no agent

    # Health: degraded only when no ok one is left, unhealthy never, ok again: traffic
    # returns without a re-join.
    ok, degraded = await instances(gw, health, [f"{health}-ok", f"{health}-degraded"])
    await degraded.heartbeat("degraded")

    async def five() -> Counter[str]:
        return Counter([await served_by(http, gw, health) for _ in range(5)])

    assert await five() == {ok.instance_id: 5}
    await ok.heartbeat("unhealthy")
    assert await five() == {degraded.instance_id: 5}
    await degraded.heartbeat("unhealthy")
    r = await invoke(http, gw, health, timeout_ms=3000)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "no_instance"
    await ok.heartbeat("ok")
    assert await five() == {ok.instance_id: 5}
    assert (ok.joins, degraded.joins) == (1, 1)


async def test_a_join_max_inflight_alone_is_enforced(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    capability = JOIN_LIMIT
    # Round robin, no configured limit: the Join's max_inflight alone must turn counting on.
    gw, _ = pair
    [small] = await instances(gw, capability, [f"{capability}-small"], max_inflight=1)
    [big] = await instances(gw, capability, [f"{capability}-big"])
    small.hold()
    first: list[asyncio.Task[str]] = []
    try:
        while not small.active:
            assert len(first) < 4, small.calls
            first.append(asyncio.create_task(served_by(http, gw, capability)))
            await wait_until(lambda: _settled(first[-1], small), 20, every_s=0.02)
        # Round robin alternates: unchecked, one of these two would go to the full instance.
        for _ in range(2):
            r = await invoke(http, gw, capability, timeout_ms=1500)
            assert r.status_code == 200, r.text
            assert r.json()["instance_id"] == big.instance_id
    finally:
        small.release()
        await asyncio.gather(*first, return_exceptions=True)


async def test_max_inflight_holds_across_gateways_after_a_quiet_spell(
    pair: tuple[GatewayProcess, GatewayProcess],
    module_redis_prefix: str,
    redis_url: str,
    http: httpx.AsyncClient,
    instances: Any,
) -> None:
    import redis.asyncio as aioredis

    capability = STALE  # max_inflight 1
    a, b = pair
    [only] = await instances(a, capability, [f"{capability}-01"])
    await served_by(http, b, capability)  # B has routed the capability (and read the counts)
    only.hold()
    held = asyncio.create_task(served_by(http, a, capability))
    r = aioredis.Redis.from_url(redis_url)
    try:

        async def shared() -> bool:
            return (
                only.active == 1 and await r.zcard(f"{module_redis_prefix}:inf:{capability}") == 1
            )

        await wait_until(shared, 20)
        await asyncio.sleep(0.5)  # well past inflight_refresh_ms (100 ms)
        # Full, as Redis has it: B must refuse (503) rather than send a second call.
        reply = await invoke(http, b, capability, timeout_ms=1500)
        assert reply.status_code == 503, reply.text
        assert len(only.calls) == 2
    finally:
        await r.aclose()
        only.release()
        await asyncio.gather(held, return_exceptions=True)


# -- 7. how fresh each process's view is --------------------------------------------------------


async def test_a_join_and_an_eviction_reach_the_other_gateways_routing_quickly(
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    http: httpx.AsyncClient,
    instances: Any,
) -> None:
    capability = name("fresh")
    # No periodic resync within the test: only the change events can make B's view fresh.
    extra = {"REACH_ROUTING__VIEW_RESYNC_S": "600"}
    sa, sb = stacks(temporal_server, tmp_path, redis_prefix, 2, extra)
    sa.heartbeat_timeout = sb.heartbeat_timeout = 2.0
    a, b = await gateways(sa, sb)
    [first] = await instances(a, capability, [f"{capability}-first"])
    assert await served_by(http, b, capability) == first.instance_id

    [second] = await instances(a, capability, [f"{capability}-second"])  # joined on A

    async def b_routes_to_second() -> bool:
        return await served_by(http, b, capability) == second.instance_id

    took = await wait_until(b_routes_to_second, 10, every_s=0)
    print(f"a join on gateway A was routable from gateway B {took * 1000:.0f} ms later")
    assert took < 5.0
    seen = Counter([await served_by(http, b, capability) for _ in range(10)])
    assert seen == {first.instance_id: 5, second.instance_id: 5}, seen

    # Silent (still serving, no heartbeats): evicted after heartbeat_timeout, and gone from
    # B's routing -- were B's view stale, B would still send it calls, and they would succeed.
    second.silence()
    silenced = time.monotonic()

    async def b_passes_it_over() -> bool:
        return Counter([await served_by(http, b, capability) for _ in range(4)]) == {
            first.instance_id: 4
        }

    await wait_until(b_passes_it_over, 15, every_s=0.05)
    since = time.monotonic() - silenced
    print(f"evicted from gateway B's routing {since:.2f}s after it fell silent")
    assert since < 2.0 + 5.0
    calls = len(second.calls)
    assert Counter([await served_by(http, b, capability) for _ in range(10)]) == {
        first.instance_id: 10
    }
    assert len(second.calls) == calls


async def test_requests_that_never_call_hold_no_in_flight_slot(
    pair: tuple[GatewayProcess, GatewayProcess], http: httpx.AsyncClient, instances: Any
) -> None:
    """The door counts attempt 1 in flight until its call begins. A request that ends before
    (its deadline came first, its idempotency key answered) frees that count at once: found
    by review, two such requests left both instances 'at max_inflight' for 2 s."""
    capability = NEVER_CALLS  # least request, max_inflight 1
    gateway, _ = pair
    await instances(gateway, capability, [f"{capability}-{i}" for i in range(2)])
    for _ in range(3):  # the door's views are warm
        await served_by(http, gateway, capability)
    tiny = await asyncio.gather(*(invoke(http, gateway, capability, timeout_ms=1) for _ in (1, 2)))
    assert [r.status_code for r in tiny] == [504, 504], [r.text for r in tiny]
    await served_by(http, gateway, capability, idempotency_key="once", request_id=rid())
    replays = await asyncio.gather(
        *(
            invoke(http, gateway, capability, idempotency_key="once", timeout_ms=DEADLINE_MS)
            for _ in (1, 2)
        )
    )
    assert all(r.json().get("replayed_from") for r in replays), [r.text for r in replays]
    detail = (await http.get(f"{gateway.url}/reach/capabilities/{capability}")).json()
    assert detail["routing"]["inflight"] == {}
    await served_by(http, gateway, capability)  # not 503 "at its max_inflight"
