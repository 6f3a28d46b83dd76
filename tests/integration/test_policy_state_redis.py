"""The policy state over both backends, memory and a real Redis: the same scenarios give the
same answers, and Redis's own keys all expire."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_api.devserver import free_port
from reach.config import CircuitBreakerSettings, OutlierSettings
from reach.errors import Unavailable
from reach.policy.redis_state import RedisPolicyState
from reach.policy.state import (
    Admission,
    BreakerView,
    Bucket,
    CapabilityView,
    MemoryPolicyState,
    PolicyState,
    create_policy_state,
)
from reach.store import MemoryStore
from reach.store.redis import RedisStore
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000
BREAKER = CircuitBreakerSettings(error_threshold=3, open_duration_ms=HOUR_MS)
OUTLIER = OutlierSettings(consecutive_failures=2, base_ejection_ms=HOUR_MS, max_ejection_ms=HOUR_MS)
NO_OUTLIER = OutlierSettings(enabled=False)
OFF = CircuitBreakerSettings(enabled=False)
SLOW = 0.001  # tokens a minute: no refill within a test


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[PolicyState]:
    if request.param == "memory":
        yield create_policy_state(MemoryStore())
        return
    store = RedisStore.from_url(redis_url, prefix=request.getfixturevalue("redis_prefix"))
    try:
        yield create_policy_state(store)
    finally:
        await store.aclose()


@pytest.fixture
async def redis_state(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisPolicyState]:
    store = RedisStore.from_url(redis_url, prefix=redis_prefix)
    policy = create_policy_state(store)
    assert isinstance(policy, RedisPolicyState)
    try:
        yield policy
    finally:
        await store.aclose()


async def outcomes(
    state: PolicyState,
    oks: list[bool],
    breaker: CircuitBreakerSettings = BREAKER,
    outlier: OutlierSettings = NO_OUTLIER,
    instance: str = "a",
) -> list[CapabilityView]:
    return [await state.record("cap", instance, ok, breaker, outlier) for ok in oks]


def hour_left(seconds: float) -> bool:
    # `until - now` on the memory backend's float clock can come out a hair over the hour.
    return 3590 < seconds <= 3600 + 1e-6


# --- Both backends, no clock involved -------------------------------------------------------


async def test_consecutive_failures_open_it_and_late_reports_are_ignored(
    state: PolicyState,
) -> None:
    views = await outcomes(state, [False, False, True, False, False])
    assert [v.breaker for v in views] == [BreakerView("closed", n) for n in (1, 2, 0, 1, 2)]
    opened = (await outcomes(state, [False]))[0].breaker
    assert (opened.status, opened.failures, hour_left(opened.retry_after_s)) == ("open", 0, True)
    refused = await state.admit("cap", BREAKER)
    assert (refused.allowed, refused.status, refused.probe) == (False, "open", False)
    assert hour_left(refused.retry_after_s)
    late = await outcomes(state, [True, False, False, False])
    assert {(v.breaker.status, v.breaker.failures) for v in late} == {("open", 0)}
    assert await state.admit("other", BREAKER) == Admission(True, "closed")


async def test_window_counts_failures_among_the_last_n_outcomes(state: PolicyState) -> None:
    windowed = CircuitBreakerSettings(error_threshold=2, window=4, open_duration_ms=HOUR_MS)
    views = await outcomes(state, [False, True, True, True, True, False, True, False], windowed)
    seen = [(v.breaker.status, v.breaker.failures) for v in views]
    assert seen == [("closed", n) for n in (1, 1, 1, 1, 0, 1, 1)] + [("open", 0)]


async def test_a_disabled_breaker_admits_everything_but_outliers_still_count(
    state: PolicyState,
) -> None:
    off = CircuitBreakerSettings(enabled=False, error_threshold=1)
    view = (await outcomes(state, [False] * 5, off, OUTLIER))[-1]
    assert (view.breaker, set(view.ejected), view.failing) == (BreakerView(), {"a"}, frozenset("a"))
    assert await state.admit("cap", off) == Admission(True, "closed")
    assert (await state.view("cap", BREAKER)).breaker == BreakerView()


async def test_outlier_ejects_after_a_run_and_a_success_resets_it(state: PolicyState) -> None:
    views = await outcomes(state, [False, False, False], OFF, OUTLIER)
    assert [(set(v.ejected), v.failing) for v in views] == [
        (set(), frozenset("a")),
        ({"a"}, frozenset()),
        ({"a"}, frozenset("a")),
    ]
    assert hour_left(views[-1].ejected["a"])
    view = (await outcomes(state, [False], OFF, OUTLIER, instance="b"))[0]
    assert (set(view.ejected), view.failing) == ({"a"}, frozenset("ab"))
    view = (await outcomes(state, [True], OFF, OUTLIER))[0]
    assert (set(view.ejected), view.failing) == ({"a"}, frozenset("b"))  # still serves its ejection
    view = (await outcomes(state, [False] * 3, OFF, NO_OUTLIER, instance="c"))[-1]
    assert (set(view.ejected), view.failing) == ({"a"}, frozenset("b"))
    again = await state.view("cap", OFF)
    assert (again.breaker, set(again.ejected), again.failing) == (
        BreakerView(),
        {"a"},
        frozenset("b"),
    )


async def test_record_returns_what_view_would(state: PolicyState) -> None:
    for ok, instance in [(False, "a"), (False, "b"), (False, "a"), (True, "b"), (False, "a")]:
        recorded = await state.record("cap", instance, ok, BREAKER, OUTLIER)
        viewed = await state.view("cap", BREAKER)
        assert (recorded.breaker.status, recorded.breaker.failures, recorded.failing) == (
            viewed.breaker.status,
            viewed.breaker.failures,
            viewed.failing,
        )
        assert set(recorded.ejected) == set(viewed.ejected)


async def test_take_takes_one_from_every_bucket_or_from_none(state: PolicyState) -> None:
    caller = Bucket("caller", per_minute=SLOW, capacity=2)
    cap = Bucket("cap", per_minute=SLOW, capacity=5)
    assert await state.buckets(["caller", "cap"]) == {}
    assert await state.take([caller, cap]) == 0.0
    assert await state.take([caller, cap]) == 0.0
    wait = await state.take([caller, cap])
    assert 59_000 < wait <= 60_000  # a token every 60 000 s
    assert await state.take([cap]) == 0.0
    found = await state.buckets(["caller", "cap", "nope"])
    assert found == {"caller": pytest.approx(0.0, abs=1e-3), "cap": pytest.approx(2.0, abs=1e-3)}
    assert await state.take([]) == 0.0


async def test_claims_are_set_if_absent_and_released_only_by_their_holder(
    state: PolicyState,
) -> None:
    assert await state.claim("k", "first", ttl_s=60) == "first"
    assert await state.claim("k", "second", ttl_s=60) == "first"
    assert not await state.release("k", "second")
    assert await state.release("k", "first")
    assert not await state.release("k", "first")
    assert await state.claim("k", "second", ttl_s=60) == "second"


async def test_a_put_overwrites_whatever_the_key_holds_and_peek_reads_it(
    state: PolicyState,
) -> None:
    assert await state.peek("progress:r") is None
    await state.put("progress:r", "one", ttl_s=60)
    await state.put("progress:r", "two", ttl_s=60)
    assert await state.peek("progress:r") == "two"
    assert await state.claim("progress:r", "three", ttl_s=60) == "two"
    await state.put("progress:r", "gone", ttl_s=0.05)
    await wait_until(lambda: _absent(state, "progress:r"), 5)


async def _absent(state: PolicyState, key: str) -> bool:
    return await state.peek(key) is None


# --- Redis, with real (short) durations -----------------------------------------------------

SHORT = CircuitBreakerSettings(error_threshold=1, open_duration_ms=400, half_open_probes=2)


async def test_half_open_after_the_open_duration_and_probes_close_it(
    redis_state: RedisPolicyState,
) -> None:
    state = redis_state
    await state.record("cap", "a", False, SHORT, NO_OUTLIER)
    await asyncio.sleep(0.6)
    assert (await state.view("cap", SHORT)).breaker == BreakerView("half_open")
    assert await state.admit("cap", SHORT) == Admission(True, "half_open", probe=True)
    assert await state.admit("cap", SHORT) == Admission(True, "half_open", probe=True)
    refused = await state.admit("cap", SHORT)
    assert (refused.allowed, refused.status, refused.probe) == (False, "half_open", False)
    assert 0 < refused.retry_after_s <= 0.4
    # Not a probe: admitted before it opened, ignored.
    await state.record("cap", "a", True, SHORT, NO_OUTLIER)
    view = await state.record("cap", "a", True, SHORT, NO_OUTLIER, probe=True)
    assert view.breaker == BreakerView("half_open")
    view = await state.record("cap", "a", True, SHORT, NO_OUTLIER, probe=True)
    assert view.breaker == BreakerView("closed", 0)
    assert await state.admit("cap", SHORT) == Admission(True, "closed")


async def test_a_failure_in_half_open_reopens_it_and_dead_probes_free_their_slot(
    redis_state: RedisPolicyState,
) -> None:
    state = redis_state
    one = SHORT.model_copy(update={"half_open_probes": 1})
    await state.record("cap", "a", False, one, NO_OUTLIER)
    await asyncio.sleep(0.6)
    assert (await state.admit("cap", one)).probe
    assert not (await state.admit("cap", one)).allowed
    await asyncio.sleep(0.6)  # the probe never reported: its lease ran out
    assert await state.admit("cap", one) == Admission(True, "half_open", probe=True)
    view = await state.record("cap", "a", False, one, NO_OUTLIER, probe=True)
    assert (view.breaker.status, 0 < view.breaker.retry_after_s <= 0.4) == ("open", True)
    await asyncio.sleep(0.6)
    assert await state.admit("cap", one) == Admission(True, "half_open", probe=True)


async def test_ejections_end_and_double(redis_state: RedisPolicyState) -> None:
    short = OutlierSettings(consecutive_failures=1, base_ejection_ms=200, max_ejection_ms=10_000)
    first = await redis_state.record("cap", "a", False, OFF, short)
    assert 0 < first.ejected["a"] <= 0.2
    await asyncio.sleep(0.3)
    assert (await redis_state.view("cap", OFF)).ejected == {}
    second = await redis_state.record("cap", "a", False, OFF, short)
    assert 0.2 < second.ejected["a"] <= 0.4


async def test_buckets_refill(redis_state: RedisPolicyState) -> None:
    fast = Bucket("fast", per_minute=600, capacity=1)  # a token every 0.1 s
    assert await redis_state.take([fast]) == 0.0
    assert 0 < await redis_state.take([fast]) <= 0.1
    await asyncio.sleep(0.15)
    assert await redis_state.take([fast]) == 0.0


async def test_key_layout_and_every_key_expires(
    redis_state: RedisPolicyState, redis_url: str, redis_prefix: str
) -> None:
    await redis_state.record("cap", "b", True, BREAKER, OUTLIER)  # nothing to keep: no key
    await redis_state.record("cap", "a", False, BREAKER, OUTLIER)
    await redis_state.take([Bucket("caller:cap", per_minute=60, capacity=10)])
    await redis_state.claim("idem", "x", ttl_s=30)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = sorted([k async for k in client.scan_iter(match=f"{redis_prefix}:*")])
        assert keys == [
            f"{redis_prefix}:pol:{name}"
            for name in ("brk:cap", "claim:idem", "out:cap", "tb:caller:cap")
        ]
        ttls = {k.rsplit(":pol:", 1)[1]: await client.pttl(k) for k in keys}
        assert HOUR_MS + 6 * HOUR_MS - 60_000 < ttls["brk:cap"] <= HOUR_MS + 6 * HOUR_MS
        assert HOUR_MS + 300_000 - 60_000 < ttls["out:cap"] <= HOUR_MS + 300_000
        assert 1000 < ttls["tb:caller:cap"] <= 2000  # full again after 1 s, plus 1 s
        assert 25_000 < ttls["claim:idem"] <= 30_000
        # The run's failures, and who had them (the breaker's quorum: reach.policy.breaker).
        assert await client.hgetall(f"{redis_prefix}:pol:brk:cap") == {"fail": "1", "who": "a"}
        entry = await client.hget(f"{redis_prefix}:pol:out:cap", "a")
        assert entry is not None
        assert entry.split()[:3] == ["1", "0", "0"]
    finally:
        await client.aclose()


async def test_a_redis_that_is_down_is_unavailable() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="x", timeout_s=0.5)
    state = create_policy_state(store)
    try:
        for call in (
            state.view("cap", BREAKER),
            state.admit("cap", BREAKER),
            state.record("cap", "a", False, BREAKER, OUTLIER),
            state.take([Bucket("b", 60, 1)]),
            state.buckets(["b"]),
            state.claim("k", "v", 1),
            state.release("k", "v"),
        ):
            with pytest.raises(Unavailable):
                await call
        assert await state.admit("cap", OFF) == Admission(True, "closed")  # no Redis needed
    finally:
        await store.aclose()


# --- Properties ------------------------------------------------------------------------------

LONG = HOUR_MS
breakers = st.builds(
    lambda window, threshold, probes: CircuitBreakerSettings(
        error_threshold=min(threshold, window) if window else threshold,
        window=window,
        open_duration_ms=LONG,
        half_open_probes=probes,
    ),
    st.sampled_from([0, 1, 3, 5]),
    st.integers(1, 4),
    st.integers(1, 3),
)
outliers = st.builds(
    lambda n, enabled: OutlierSettings(
        enabled=enabled, consecutive_failures=n, base_ejection_ms=LONG, max_ejection_ms=4 * LONG
    ),
    st.integers(1, 3),
    st.booleans(),
)
steps = st.lists(
    st.one_of(
        st.just(("admit", "", False, False)),
        st.tuples(st.just("record"), st.sampled_from("abc"), st.booleans(), st.booleans()),
    ),
    max_size=25,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(breaker=breakers, outlier=outliers, ops=steps)
async def test_both_backends_agree(
    redis_url: str,
    redis_prefix: str,
    breaker: CircuitBreakerSettings,
    outlier: OutlierSettings,
    ops: list[tuple[str, str, bool, bool]],
) -> None:
    memory = MemoryPolicyState()
    store = RedisStore.from_url(redis_url, prefix=f"{redis_prefix}:{uuid.uuid4().hex[:8]}")
    redis = create_policy_state(store)
    try:
        for op, instance, ok, probe in ops:
            if op == "admit":
                got = [await s.admit("cap", breaker) for s in (memory, redis)]
                assert got[0].retry_after_s == pytest.approx(got[1].retry_after_s, abs=1)
                assert [(a.allowed, a.status, a.probe) for a in got] == 2 * [
                    (got[0].allowed, got[0].status, got[0].probe)
                ]
                continue
            views = [
                await s.record("cap", instance, ok, breaker, outlier, probe=probe)
                for s in (memory, redis)
            ]
            mem, red = ((v.breaker.status, v.breaker.failures, v.failing) for v in views)
            assert mem == red
            assert views[0].ejected == pytest.approx(views[1].ejected, abs=1)
    finally:
        await store.aclose()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(per_minute=st.floats(60, 6000), capacity=st.integers(1, 5), n=st.integers(1, 30))
async def test_redis_take_never_lets_more_through_than_capacity_plus_refill(
    redis_url: str, redis_prefix: str, per_minute: float, capacity: int, n: int
) -> None:
    store = RedisStore.from_url(redis_url, prefix=f"{redis_prefix}:{uuid.uuid4().hex[:8]}")
    state = create_policy_state(store)
    bucket = Bucket("b", per_minute, capacity)
    try:
        start = time.monotonic()
        taken = [await state.take([bucket]) for _ in range(n)].count(0.0)
        elapsed = time.monotonic() - start
    finally:
        await store.aclose()
    # Redis counts whole milliseconds: its elapsed time may exceed ours by up to 1 ms.
    assert min(n, capacity) <= taken <= capacity + (elapsed + 0.001) * per_minute / 60
