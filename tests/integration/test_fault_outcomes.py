"""Outcomes told honestly, and faults not turned into refusals (issue 25), on real processes:
gateways, workers, agents (examples/knowledge_retriever.py, whose ledger counts executions),
a throwaway redis-server, a callback receiver that comes and goes."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reach.config import CircuitBreakerSettings, OutlierSettings
from reach.policy.breaker import IGNORED
from reach.policy.state import MemoryPolicyState, create_policy_state
from reach.store.redis import RedisStore
from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    OutageReceiver,
    Worker,
    executions,
    invoke,
    rid,
    wait_until,
)
from tests.integration.test_redis_outages import RedisServer

pytestmark = pytest.mark.integration


# The queued test's capability: its own rate limit (`policy.capabilities`), so it shares the
# module gateway with the tests that need none instead of starting one of its own.
QUEUED = f"queued-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """The module's gateway (memory registry, reach.yaml's policy); QUEUED is rate limited, and
    a callback's wait between attempts doubles up to 1 s (callback.max_backoff_s)."""
    limited = {
        QUEUED: {
            "rate_limit": {
                "per_caller": {"per_minute": 30, "burst": 1},  # a token every 2 s
                "on_limit": "queue",
            }
        }
    }
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("faults"),
        extra={
            "REACH_POLICY__CAPABILITIES": json.dumps(limited),
            "REACH_CALLBACK__MAX_BACKOFF_S": "1",
        },
    )
    async with GatewayProcess(stack) as gw:
        yield gw


async def test_a_keyless_write_whose_gateway_was_killed_mid_call_may_have_run_and_says_where(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The write runs on the agent; its gateway is SIGKILLed mid-call; the workflow task times
    out and the other gateway (same task queue) takes the request over after its deadline. It
    was sent: the caller must not be told a plain, safe-looking timeout. Nor, when the agent
    died too and the takeover (before the deadline) sent nothing, a plain failure."""
    stack = new_stack(
        temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix, heartbeat_timeout=30.0
    )
    doomed = GatewayProcess(stack, "doomed")  # eager start: the call runs in this process
    other = GatewayProcess(stack, "other")  # its worker takes the request over
    await asyncio.gather(doomed.ready(), other.ready())
    ledger = tmp_path / "ledger.txt"
    flags = ("--delay-ms", "60000", "--ledger", str(ledger))
    warm, cold, grpc = await asyncio.gather(
        Agent(other, "warm-01", "writes-warm", *flags).ready(),
        Agent(other, "cold-01", "writes-cold", *flags).ready(),
        Agent(other, "grpc-01", "writes-grpc", "--protocol", "grpc", *flags).ready(),
    )
    # One capability the door has routed before (it routes attempt 1 itself), one it has not
    # (the workflow resolves attempt 1 and pins it in the store).
    r = await invoke(http, doomed, "writes-warm", "get_metadata")
    assert r.status_code == 200, r.text
    async with CallbackReceiver() as receiver:
        sent = {}
        for agent, capability in ((warm, "writes-warm"), (cold, "writes-cold")):
            request_id = rid()
            r = await invoke(
                http,
                doomed,
                capability,
                "create",
                request_id=request_id,
                timeout_ms=6000,  # shorter than a takeover (the workflow task timeout, 10 s)
                callback=receiver.url,
            )
            assert r.status_code == 202, r.text
            sent[request_id] = agent.instance_id
        # One whose deadline outlives the takeover, its agent SIGKILLed with the gateway: the
        # run that takes it over goes back to it, cannot connect, and sends nothing itself; the
        # lost run had sent it (the reliability suite saw a plain transport_error here).
        lost = rid()
        r = await invoke(
            http,
            doomed,
            "writes-grpc",
            "create",
            request_id=lost,
            timeout_ms=40_000,
            callback=receiver.url,
        )
        assert r.status_code == 202, r.text

        def running() -> bool:
            return all(executions(ledger, request_id) for request_id in [*sent, lost])

        await wait_until(running, 15, every_s=0.02)
        doomed.proc.kill()
        grpc.proc.kill()
        await receiver.wait(3, timeout_s=60)
        envelopes = {e["request_id"]: e for _, e in receiver.received}
    assert set(envelopes) == {*sent, lost}, other.proc.output()[-3000:]
    envelope = envelopes[lost]
    assert envelope["status"] == "error", envelope
    assert envelope["error"]["outcome_unknown"] is True, envelope
    assert envelope["error"]["retryable"] is False, envelope
    assert envelope["instance_id"] == grpc.instance_id, envelope
    assert executions(ledger, lost) == [grpc.instance_id]
    for request_id, instance_id in sent.items():
        envelope = envelopes[request_id]
        assert envelope["status"] == "timeout", envelope
        assert envelope["error"]["outcome_unknown"] is True, envelope
        assert envelope["error"]["retryable"] is False
        assert envelope["instance_id"] == instance_id, envelope
        assert instance_id in envelope["error"]["message"]
        assert executions(ledger, request_id) == [instance_id]  # run once, never again


async def test_a_read_or_keyed_write_past_its_deadline_says_it_may_have_run_and_where(
    gateway: GatewayProcess, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """`outcome_unknown` says what Reach knows, whatever the operation's idempotency: a read
    (declared idempotent) and a write with an idempotency key, both sent and running past
    their deadline on the agent, time out saying they may have run, on which instance (they
    said nothing before: make soak found timeouts the ledger showed had run). A request
    refused before anything was sent (no instance left) says no such thing."""
    gw = gateway
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        gw, f"{capability}-01", capability, "--delay-ms", "4000", "--ledger", str(ledger)
    ).ready()
    for operation, extra in (("query", {}), ("create", {"idempotency_key": rid()})):
        request_id = rid()
        r = await invoke(
            http, gw, capability, operation, request_id=request_id, timeout_ms=1500, **extra
        )
        assert r.status_code == 504, r.text
        envelope = r.json()
        error = envelope["error"]
        assert (error["type"], error["retryable"]) == ("timeout", False), error
        assert error.get("outcome_unknown") is True, (operation, error)
        assert envelope["instance_id"] == agent.instance_id, envelope
        assert agent.instance_id in error["message"], error
        # No advice to add a key, nor "repeating it is safe" beside retryable: false; what a
        # repeat would do instead: the key keeps this answer, the read is the caller's to judge.
        assert "with an idempotency_key" not in error["message"], error
        assert "safe" not in error["message"], error
        assert (
            "sent again with the same idempotency_key it is not run again"
            if extra
            else "the operation is declared idempotent"
        ) in error["message"], error
        assert executions(ledger, request_id) == [agent.instance_id]  # it ran (it starts so)
    # The agent leaves: a request now is refused before anything is sent, and says so.
    agent.proc.stop()

    async def gone() -> bool:
        shown = await http.get(f"{gw.url}/reach/capabilities/{capability}")
        return shown.status_code == 404 or not shown.json()["instances"]

    await wait_until(gone, 20)
    request_id = rid()
    r = await invoke(http, gw, capability, "query", request_id=request_id, timeout_ms=1500)
    assert r.status_code in (404, 503), r.text
    envelope = r.json()
    assert "outcome_unknown" not in envelope["error"], envelope
    assert envelope.get("instance_id") is None, envelope
    assert executions(ledger, request_id) == []


async def test_a_queued_request_past_its_deadline_is_refused_429_never_sent(
    gateway: GatewayProcess, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """Queued requests that no token frees in time for are `rate_limited` (429, Retry-After):
    none wakes at its deadline to take a token and time out (504) with no time to call."""
    gw = gateway
    ledger = tmp_path / "ledger.txt"
    await Agent(gw, f"{QUEUED}-01", QUEUED, "--ledger", str(ledger)).ready()
    first = await invoke(http, gw, QUEUED, "query", caller="burst")
    assert first.status_code == 200, first.text  # the one token
    # The next token frees in about 2 s, before their deadline (2.2 s): the old spread
    # (at least 1.25 times the wait) woke them all at the deadline, and one took the token.
    answers = await asyncio.gather(
        *(invoke(http, gw, QUEUED, "query", caller="burst", timeout_ms=2200) for _ in range(4))
    )
    codes = Counter(r.status_code for r in answers)
    assert set(codes) <= {200, 429}, [r.text for r in answers]
    assert codes[429] >= 1
    for r in answers:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limited"
            assert int(r.headers["Retry-After"]) >= 1
    # Every 200 ran once; no 429 reached the agent.
    ran = [line for line in ledger.read_text().splitlines() if line.strip()]
    assert len(ran) == 1 + codes[200]


async def test_one_failing_instance_among_three_never_opens_the_capability_s_breaker(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """One instance fails every call at once while its two peers answer (slowly): its failures
    come in a run, with no success between them. Ejection takes it out and the retries go to
    its peers; the capability's breaker stays closed (it opened, and refused every request
    circuit_open, while two instances were healthy)."""
    gw = gateway
    await asyncio.gather(
        Agent(gw, "b-00", capability, "--fail-first", "1000").ready(),
        Agent(gw, "b-01", capability, "--delay-ms", "800").ready(),
        Agent(gw, "b-02", capability, "--delay-ms", "800").ready(),
    )
    # A long timeout_ms: a loaded box must not time the healthy ones out (that would be
    # the capability failing, and open the breaker).
    calls = [invoke(http, gw, capability, "query", timeout_ms=30_000) for _ in range(9)]
    burst = await asyncio.gather(*calls)
    after = [await invoke(http, gw, capability, "query", timeout_ms=30_000) for _ in range(4)]
    detail = (await http.get(f"{gw.url}/reach/capabilities/{capability}")).json()
    refused = [r.json() for r in burst + after if r.status_code != 200]
    assert refused == [], refused
    # The ones that met the failing instance were retried on a healthy one; then none met it.
    assert {r.json()["instance_id"] for r in burst + after} == {"b-01", "b-02"}
    assert all(len(r.json()["attempts"]) == 1 for r in after)
    assert detail["policy"]["breaker"]["status"] == "closed", detail["policy"]
    assert "b-00" in detail["policy"]["ejected"], detail["policy"]


async def test_an_accepted_request_outlives_a_registry_restarted_empty(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """Accepted (202) while its capability was known; Redis then restarts empty before a worker
    routes it. Its agents join again at their next heartbeat: the request waits for them (the
    store's backoff) rather than ending unknown_capability a moment before."""
    redis = RedisServer()
    redis.start()
    try:
        stack = new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            heartbeat_timeout=30.0,
            extra={"REACH_REGISTRY__REDIS_URL": redis.url},
        )
        api = await GatewayProcess(stack, "api", worker=False).ready()
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(api, "r-01", "remembered", "--ledger", str(ledger)).ready()
        async with CallbackReceiver() as receiver:
            request_id = rid()
            r = await invoke(
                http,
                api,
                "remembered",
                request_id=request_id,
                timeout_ms=60_000,
                callback=receiver.url,
            )
            assert r.status_code == 202, r.text
            agent.proc.kill(signal.SIGSTOP)  # no heartbeat, so no re-join, until it is let go
            redis.stop()
            port = redis.port
            redis = RedisServer()
            redis.port, redis.url = port, f"redis://127.0.0.1:{port}/0"
            redis.start()  # empty: no capability, no instance
            worker = await Worker(stack).ready()

            def routed() -> bool:
                return "unknown_capability" in worker.proc.output()

            await wait_until(routed, 30)  # the worker met the empty registry
            agent.proc.kill(signal.SIGCONT)  # its next heartbeat is refused: it joins again
            await receiver.wait(1, timeout_s=45)
            assert receiver.received, worker.proc.output()[-3000:]
            envelope = receiver.received[0][1]
        assert envelope["status"] == "success", envelope
        assert envelope["instance_id"] == agent.instance_id
        assert executions(ledger, request_id) == [agent.instance_id]
    finally:
        redis.stop()


async def test_a_callback_receiver_that_is_back_is_served_within_seconds(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """The receiver is down for 8 s from the first attempt: with the delivery backoff bounded
    (callback.max_backoff_s, 1 s here), the callback arrives within about that of its return,
    not at the next doubling (0.2 s at first, so attempts 6.2 s and 12.6 s after the first one;
    minutes apart after a longer outage)."""
    await Agent(gateway, f"{capability}-01", capability).ready()
    receiver = OutageReceiver()
    try:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]

        async def done() -> bool:
            read = await http.get(f"{gateway.url}/reach/requests/{request_id}")
            return bool(read.json()["status"] != "running")

        await wait_until(done, 15)  # the result is final; its delivery is failing
        await asyncio.sleep(8.0)  # the receiver's outage (nothing to wait for: it is the fault)
        back = await receiver.up()
        await wait_until(lambda: bool(receiver.arrived), 30, every_s=0.05)
        served_after_s = receiver.arrived[0][0] - back
        assert receiver.arrived[0][1]["request_id"] == request_id
        assert served_after_s < 3.0, served_after_s
    finally:
        await receiver.close()


# The breaker's quorum, the same in Lua as in memory (as tests/integration/test_policy_state_redis
# checks the rest of the two backends).
LONG = 60_000
quorum_breakers = st.builds(
    lambda threshold, window: CircuitBreakerSettings(
        error_threshold=min(threshold, window) if window else threshold,
        window=window,
        open_duration_ms=LONG,
    ),
    st.integers(1, 4),
    st.sampled_from([0, 3, 5]),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    breaker=quorum_breakers,
    ops=st.lists(
        st.tuples(
            st.sampled_from("abc"),
            st.booleans(),
            st.sampled_from([IGNORED, 1, 2, 3]),
            # Who routing serves from then ("": it could not say): the others' failures leave
            # the quorum (reach.policy.breaker).
            st.sampled_from(["", "abc", "ab", "bc", "ac", "a"]),
        ),
        max_size=25,
    ),
)
# One agent ("a") fails 3 times, leaves and comes back as "c", which fails, then a peer fails:
# closed, closed, open (tests/unit/test_policy_state.py), in Lua too (its second script).
@example(
    breaker=CircuitBreakerSettings(error_threshold=3, window=0, open_duration_ms=LONG),
    ops=[("a", False, 2, "abc")] * 3 + [("c", False, 2, "bc"), ("b", False, 2, "bc")],
)
@example(
    breaker=CircuitBreakerSettings(error_threshold=3, window=5, open_duration_ms=LONG),
    ops=[("a", False, 2, "abc")] * 3 + [("c", False, 2, "bc"), ("b", False, 2, "bc")],
)
async def test_both_backends_count_the_breaker_s_quorum_alike(
    redis_url: str,
    redis_prefix: str,
    breaker: CircuitBreakerSettings,
    ops: list[tuple[str, bool, int, str]],
) -> None:
    memory = MemoryPolicyState()
    store = RedisStore.from_url(redis_url, prefix=f"{redis_prefix}:{uuid.uuid4().hex[:8]}")
    redis = create_policy_state(store)
    outlier = OutlierSettings(consecutive_failures=2, base_ejection_ms=LONG, max_ejection_ms=LONG)
    try:
        for instance, ok, need, serves in ops:
            views = [
                await s.record(
                    "cap", instance, ok, breaker, outlier, quorum=need, serving=list(serves)
                )
                for s in (memory, redis)
            ]
            mem, red = ((v.breaker.status, v.breaker.failures, v.failing) for v in views)
            assert mem == red
            assert set(views[0].ejected) == set(views[1].ejected)
    finally:
        await store.aclose()
