"""The policy engine, counted the way Dapr's resiliency suite counts: agent calls in a ledger.

Real gateways and agent processes over real sockets; the agents (examples/knowledge_retriever.py)
append `<request_id> <instance_id>` to a ledger for every execution, failed ones included, so
every assertion below is an exact number of downstream calls.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    Worker,
    invoke,
    rid,
    start_agents,
    wait_until,
)

pytestmark = pytest.mark.integration

# Short backoffs keep the suite quick; the arithmetic (1 + retries) is what is tested.
FAST = {"REACH_POLICY__RETRY__BACKOFF_BASE_MS": "300"}


def calls(ledger: Path, request_id: str | None = None) -> list[str]:
    """The instances that executed `request_id` (or anything), in order."""
    if not ledger.exists():
        return []
    rows = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    return [inst for req, inst in rows if request_id is None or req == request_id]


async def executing(ledger: Path, request_id: str, timeout_s: float) -> None:
    """Until an agent has started running `request_id`."""

    async def started() -> bool:
        return bool(calls(ledger, request_id))

    await wait_until(started, timeout_s, every_s=0.02)


@pytest.fixture(scope="module")
async def fast_gateway(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # A breaker that opens after 5 failures: these tests count up to 3 on one capability.
    extra = {**FAST, "REACH_POLICY__CIRCUIT_BREAKER__ERROR_THRESHOLD": "5"}
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("policy"), extra=extra)
    async with GatewayProcess(stack) as gw:
        yield gw


async def test_idempotent_op_failing_twice_then_succeeding_takes_exactly_three_calls(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    # The agents fail the first two calls (counted over all three), then succeed.
    await start_agents(
        fast_gateway, capability, 3, "--ledger", str(ledger), "--fail-first", "2", "--fail-shared"
    )
    request_id = rid()
    r = await invoke(http, fast_gateway, capability, "query", request_id=request_id)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success"
    assert len(calls(ledger, request_id)) == 3
    assert len(set(calls(ledger, request_id))) == 3  # every attempt on another instance
    attempts = body["attempts"]
    assert [a["outcome"] for a in attempts] == ["agent_error", "agent_error", "success"]
    assert [a.get("backoff_ms") for a in attempts] == [300, 600, None]
    assert [a["instance_id"] for a in attempts] == calls(ledger, request_id)


async def test_always_failing_takes_one_plus_default_retry_calls_then_the_last_error(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger), "--fail-first", "99")
    request_id = rid()
    r = await invoke(http, fast_gateway, capability, "query", request_id=request_id)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "agent_error"
    assert len(calls(ledger, request_id)) == 1 + 2


async def test_a_running_request_shows_its_attempts_so_far(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    await start_agents(fast_gateway, capability, 1, "--fail-first", "99")
    async with CallbackReceiver() as receiver:
        request_id = rid()
        r = await invoke(
            http, fast_gateway, capability, "query", request_id=request_id, callback=receiver.url
        )
        assert r.status_code == 202, r.text
        seen: list[int] = []  # attempts listed while it was still running (in its backoffs)
        while True:
            body = (await http.get(f"{fast_gateway.url}/reach/requests/{request_id}")).json()
            if body["status"] != "running":
                break
            seen.append(len(body.get("attempts", [])))
            await asyncio.sleep(0.02)
        assert body["status"] == "error"
        assert len(body["attempts"]) == 3
        assert set(seen) & {1, 2}, seen


async def test_non_idempotent_failing_is_called_once_and_retried_only_with_a_key(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    # Two instances, each failing its first call.
    await start_agents(fast_gateway, capability, 2, "--ledger", str(ledger), "--fail-first", "1")
    bare = rid()
    r = await invoke(http, fast_gateway, capability, "create", request_id=bare)
    assert r.status_code == 502, r.text
    assert len(calls(ledger, bare)) == 1
    keyed = rid()
    r = await invoke(
        http, fast_gateway, capability, "create", request_id=keyed, idempotency_key="order-1"
    )
    assert r.status_code == 200, r.text
    # Round robin sends it to the other instance, whose first call fails; the retry goes to
    # the instance that already failed once and is past it.
    made = calls(ledger, keyed)
    assert len(made) == 2
    assert len(set(made)) == 2
    assert [a["outcome"] for a in r.json()["attempts"]] == ["agent_error", "success"]


async def test_an_agent_4xx_is_called_exactly_once(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await start_agents(
        fast_gateway,
        capability,
        2,
        "--ledger",
        str(ledger),
        "--fail-first",
        "9",
        "--fail-status",
        "422",
    )
    request_id = rid()
    r = await invoke(http, fast_gateway, capability, "query", request_id=request_id)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["agent"]["status"] == 422
    assert len(calls(ledger, request_id)) == 1


async def test_same_key_other_payload_is_409_with_no_call(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger))
    key = f"k-{uuid.uuid4().hex}"
    first = await invoke(
        http, fast_gateway, capability, "create", payload={"note": "a"}, idempotency_key=key
    )
    assert first.status_code == 200, first.text
    other = rid()
    r = await invoke(
        http,
        fast_gateway,
        capability,
        "create",
        request_id=other,
        payload={"note": "b"},
        idempotency_key=key,
    )
    assert r.status_code == 409, r.text
    assert r.json()["error"]["type"] == "idempotency_conflict"
    assert calls(ledger, other) == []
    assert len(calls(ledger)) == 1
    # Another caller's same key is another key.
    r = await invoke(
        http,
        fast_gateway,
        capability,
        "create",
        payload={"note": "b"},
        idempotency_key=key,
        caller="someone-else",
    )
    assert r.status_code == 200, r.text
    assert len(calls(ledger)) == 2


async def test_a_key_freed_when_nothing_was_sent(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    """A keyed request that reached no agent keeps no result: the same key runs later."""
    ledger = tmp_path / "ledger.txt"
    [agent] = await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger))
    agent.proc.stop()  # leaves: the capability stays known, with no instance
    await asyncio.sleep(0.5)
    key = f"k-{uuid.uuid4().hex}"
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.status_code == 503, r.text
    await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger))
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.status_code == 200, r.text
    assert "replayed_from" not in r.json()


async def test_a_key_frees_after_a_retryable_failure_and_holds_after_a_timeout(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger), "--fail-first", "3")
    key = f"k-{uuid.uuid4().hex}"
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.status_code == 502, r.text  # keyed: retried twice, every attempt failed
    assert r.json()["error"]["retryable"] is True
    assert len(calls(ledger)) == 3
    # The agent answered each time with a failure: repeating the key runs it (and succeeds).
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.status_code == 200, r.text
    assert "replayed_from" not in r.json()
    assert len(calls(ledger)) == 4
    # Now it holds that success.
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.json()["replayed_from"]
    assert len(calls(ledger)) == 4


async def test_a_timed_out_keyed_write_is_not_run_again(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await start_agents(fast_gateway, capability, 1, "--ledger", str(ledger), "--delay-ms", "1500")
    key = f"k-{uuid.uuid4().hex}"
    first = await invoke(
        http, fast_gateway, capability, "create", idempotency_key=key, timeout_ms=800
    )
    assert first.status_code == 504, first.text
    await asyncio.sleep(1.0)  # the agent finished it meanwhile
    r = await invoke(http, fast_gateway, capability, "create", idempotency_key=key)
    assert r.status_code == 504, r.text
    assert r.json()["replayed_from"] == first.json()["request_id"]
    assert len(calls(ledger)) == 1


async def test_an_agent_killed_mid_write_is_an_unknown_outcome_not_a_retryable_one(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    [agent] = await start_agents(
        fast_gateway, capability, 1, "--ledger", str(ledger), "--delay-ms", "3000"
    )
    request_id = rid()
    call = asyncio.create_task(
        invoke(http, fast_gateway, capability, "create", request_id=request_id, timeout_ms=20_000)
    )

    await executing(ledger, request_id, 10)
    agent.proc.kill()
    r = await call
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "transport_error"
    # It ran; following `retryable` would run it twice.
    assert (error["outcome_unknown"], error["retryable"]) == (True, False)
    assert calls(ledger, request_id) == [agent.instance_id]


async def test_a_callers_short_deadlines_do_not_open_the_breaker(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(fast_gateway, capability, 1, "--delay-ms", "600")
    for _ in range(6):  # more than the threshold (5 here)
        r = await invoke(http, fast_gateway, capability, "query", timeout_ms=100)
        assert r.status_code == 504, r.text
    r = await invoke(http, fast_gateway, capability, "query")
    assert r.status_code == 200, r.text
    detail = (await http.get(f"{fast_gateway.url}/reach/capabilities/{capability}")).json()
    assert detail["policy"]["breaker"] == {"status": "closed", "failures": 0, "retry_after_s": 0}
    assert detail["policy"]["ejected"] == {}


async def test_per_operation_timeouts_differ_against_the_same_slow_agent(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    # reach.yaml (the module gateway's too): knowledge-retriever:query 3 s,
    # content-generator:generate 30 s; no other test here uses those two capabilities.
    await asyncio.gather(
        *(
            Agent(fast_gateway, f"{cap}-slow", cap, "--delay-ms", "4500").ready()
            for cap in ("knowledge-retriever", "content-generator")
        )
    )
    # The caller asks for a minute; the operation's 3 s is the deadline. Both at once: each
    # deadline is its own request's, whatever else is in flight.
    r, generated = await asyncio.gather(
        invoke(http, fast_gateway, "knowledge-retriever", "query", timeout_ms=60_000),
        invoke(http, fast_gateway, "content-generator", "generate", payload={"prompt": "durable"}),
    )
    assert r.status_code == 504, r.text
    assert "timeout_ms=3000" in r.json()["error"]["message"]
    assert 2500 <= r.json()["duration_ms"] < 30_000  # 3 s, not the minute asked for
    assert generated.status_code == 200, generated.text
    assert generated.json()["duration_ms"] >= 4500


async def test_an_unknown_outcome_says_so(
    fast_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(fast_gateway, capability, 1, "--delay-ms", "3000")
    r = await invoke(http, fast_gateway, capability, "create", timeout_ms=800)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["outcome_unknown"] is True
    assert "idempotency_key" in error["message"]
    # An idempotent one may have run just the same (the flag says what Reach knows), but it
    # can simply be asked again: no advice to add a key.
    r = await invoke(http, fast_gateway, capability, "query", timeout_ms=800)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["outcome_unknown"] is True
    assert "with an idempotency_key" not in r.json()["error"]["message"]


# -- shared through Redis: two gateways, one deployment --------------------------------------


def redis_stack(temporal: str, tmp: Path, prefix: str, **extra: str) -> Stack:
    return new_stack(
        temporal,
        tmp,
        registry="redis",
        key_prefix=prefix,
        heartbeat_timeout=30.0,
        extra={**FAST, **extra},
    )


# The capabilities of the tests that share `pair`, each with a policy of its own
# (`policy.capabilities`), so one pair of gateways serves them all instead of a pair each.
BREAKING = f"cap-breaking-{uuid.uuid4().hex[:8]}"
EJECTING = f"cap-ejecting-{uuid.uuid4().hex[:8]}"
LIMITED = f"cap-limited-{uuid.uuid4().hex[:8]}"
HALF_OPEN = f"cap-half-open-{uuid.uuid4().hex[:8]}"
SHARED_POLICIES = {
    BREAKING: {"retry": {"max_retries": 0}, "circuit_breaker": {"open_duration_ms": 2000}},
    HALF_OPEN: {"retry": {"max_retries": 0}, "circuit_breaker": {"open_duration_ms": 2000}},
    EJECTING: {"outlier": {"base_ejection_ms": 4000}},
    LIMITED: {"rate_limit": {"per_caller": {"per_minute": 60}}},
}


@pytest.fixture(scope="module")
async def pair(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways of one deployment (one Redis registry and policy state, one task queue);
    each test uses capabilities of its own, and SHARED_POLICIES gives some their policy."""
    stack = redis_stack(
        temporal_server,
        tmp_path_factory.mktemp("pair"),
        module_redis_prefix,
        REACH_POLICY__CAPABILITIES=json.dumps(SHARED_POLICIES),
    )
    a, b = GatewayProcess(stack, "a"), GatewayProcess(stack, "b")  # both start at once
    async with a, b:
        yield a, b


async def test_one_key_two_gateways_one_execution_same_result(
    pair: tuple[GatewayProcess, GatewayProcess], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    a, b = pair
    ledger = tmp_path / "ledger.txt"
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    await start_agents(a, cap, 2, "--ledger", str(ledger), "--delay-ms", "500")
    key = f"k-{uuid.uuid4().hex}"
    first, second = rid(), rid()
    r1, r2 = await asyncio.gather(
        invoke(http, a, cap, "create", request_id=first, payload={"n": 1}, idempotency_key=key),
        invoke(http, b, cap, "create", request_id=second, payload={"n": 1}, idempotency_key=key),
    )
    assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
    assert len(calls(ledger)) == 1
    assert r1.json()["result"] == r2.json()["result"]
    replayed = [r.json() for r in (r1, r2) if "replayed_from" in r.json()]
    assert len(replayed) == 1
    assert r2.headers.get("Idempotent-Replayed") == "true" or r1.headers.get(
        "Idempotent-Replayed"
    ) == ("true")
    # Later, under a third request_id, through either gateway: still the first result.
    r3 = await invoke(
        http, b, cap, "create", request_id=rid(), payload={"n": 1}, idempotency_key=key
    )
    assert r3.json()["result"] == r1.json()["result"]
    assert len(calls(ledger)) == 1


# `make test-slow`: test_recovery's SIGKILLed gateway (finished elsewhere, answered from the
# agent's memory, one execution) and the lost queue worker below (re-delivered to the instance
# that had it) cover this in `make test`.
@pytest.mark.slow
async def test_sigkilled_gateway_mid_write_executes_once_across_three_instances(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = redis_stack(temporal_server, tmp_path, redis_prefix)
    doomed = GatewayProcess(stack, "doomed")  # eager start: the call runs in this process
    api = GatewayProcess(stack, "api", worker=False)
    survivor = Worker(stack)
    await asyncio.gather(doomed.ready(), api.ready(), survivor.ready())
    ledger = tmp_path / "ledger.txt"
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    await start_agents(api, cap, 3, "--ledger", str(ledger), "--delay-ms", "2000")
    async with CallbackReceiver() as receiver:
        request_id = rid()
        r = await invoke(
            http,
            doomed,
            cap,
            "create",
            request_id=request_id,
            timeout_ms=60_000,
            callback=receiver.url,
        )
        assert r.status_code == 202, r.text

        await executing(ledger, request_id, 10)
        doomed.proc.kill()
        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        envelope = receiver.received[0][1]
        assert envelope["status"] == "success", envelope
    # Re-run by the survivor, the same attempt went back to the same instance, which answered
    # from its memory: one execution, not one per instance.
    assert calls(ledger, request_id) == [envelope["result"]["instance_id"]]


async def test_a_lost_queue_worker_re_delivers_a_keyed_write_to_the_same_instance(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    stack = redis_stack(
        temporal_server,
        tmp_path,
        redis_prefix,
        REACH_CAPABILITIES=f'{{"{cap}": {{"mode": "queue"}}}}',
    )
    gw = GatewayProcess(stack)
    doomed = Worker(stack, "--capability", cap)
    await asyncio.gather(gw.ready(), doomed.ready())
    ledger = tmp_path / "ledger.txt"
    await start_agents(gw, cap, 2, "--ledger", str(ledger), "--delay-ms", "2000")
    async with CallbackReceiver() as receiver:
        request_id = rid()
        r = await invoke(
            http,
            gw,
            cap,
            "create",
            request_id=request_id,
            idempotency_key=f"k-{uuid.uuid4().hex}",
            timeout_ms=60_000,
            callback=receiver.url,
        )
        assert r.status_code == 202, r.text

        await executing(ledger, request_id, 15)
        doomed.proc.kill()  # the activity's heartbeat stops: Temporal notices in 10 s
        survivor = await Worker(stack, "--capability", cap).ready()
        await receiver.wait(1, timeout_s=60)
        assert len(receiver.received) == 1, survivor.proc.output()
        envelope = receiver.received[0][1]
        assert envelope["status"] == "success", envelope
        attempts = [(a["attempt"], a["outcome"]) for a in envelope["attempts"]]
        assert attempts == [(1, "transport_error"), (1, "success")], attempts
    # Re-delivered to the instance that had it (it answered from memory), not retried on the
    # other one: one execution.
    assert calls(ledger, request_id) == [envelope["result"]["instance_id"]]


async def test_breaker_opens_after_three_is_shared_and_a_probe_closes_it(
    pair: tuple[GatewayProcess, GatewayProcess], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    a, b = pair
    ledger = tmp_path / "ledger.txt"
    cap = BREAKING  # no retries, the breaker open for 2 s
    await start_agents(a, cap, 1, "--ledger", str(ledger), "--fail-first", "3")
    for _ in range(3):
        r = await invoke(http, a, cap, "query")
        assert r.status_code == 502, r.text
    assert len(calls(ledger)) == 3
    # Open: fast 503s with Retry-After, through either gateway, and no call reaches the agent.
    for gw in (a, b, a, b):
        started = time.monotonic()
        r = await invoke(http, gw, cap, "query")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "circuit_open"
        assert int(r.headers["Retry-After"]) >= 1
        assert time.monotonic() - started < 1.0
    assert len(calls(ledger)) == 3
    detail = (await http.get(f"{b.url}/reach/capabilities/{cap}")).json()
    assert detail["policy"]["breaker"]["status"] == "open"
    await asyncio.sleep(2.2)
    # Half-open: one probe reaches the (now healthy) agent; its success closes the breaker.
    r = await invoke(http, b, cap, "query")
    assert r.status_code == 200, r.text
    assert r.json()["attempts"][0]["breaker"] == "half_open"
    assert len(calls(ledger)) == 4
    for gw in (a, b):
        r = await invoke(http, gw, cap, "query")
        assert r.status_code == 200, r.text
    assert len(calls(ledger)) == 6
    detail = (await http.get(f"{a.url}/reach/capabilities/{cap}")).json()
    assert detail["policy"]["breaker"]["status"] == "closed"


async def test_half_open_lets_one_probe_through_both_gateways_until_it_succeeds(
    pair: tuple[GatewayProcess, GatewayProcess], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """Ten requests at once through two gateways sharing the Redis policy state while the
    breaker is half-open: one probe is let through (half_open_probes: 1), and while it runs
    (4 s) every other is refused circuit_open; its success closes the breaker."""
    a, b = pair
    ledger = tmp_path / "ledger.txt"
    cap = HALF_OPEN  # no retries, the breaker open for 2 s
    await start_agents(
        a, cap, 1, "--ledger", str(ledger), "--fail-first", "3", "--delay-ms", "4000"
    )
    for _ in range(3):
        r = await invoke(http, a, cap, "query")
        assert r.status_code == 502, r.text

    async def half_open() -> bool:
        detail = (await http.get(f"{b.url}/reach/capabilities/{cap}")).json()
        return bool(detail["policy"]["breaker"]["status"] == "half_open")

    await wait_until(half_open, 15)
    burst = await asyncio.gather(
        *(invoke(http, gw, cap, "query", timeout_ms=20_000) for gw in (a, b) * 5)
    )
    served = [r for r in burst if r.status_code == 200]
    refused = [r for r in burst if r.status_code == 503]
    assert len(served) + len(refused) == len(burst), [r.text for r in burst]
    assert all(r.json()["error"]["type"] == "circuit_open" for r in refused)
    probes = [r for r in served if r.json()["attempts"][0]["breaker"] == "half_open"]
    assert len(probes) == 1, [r.json()["attempts"] for r in served]
    # Anything else served came after the probe closed the breaker (a busy box), never beside it.
    assert all(r.json()["attempts"][0]["breaker"] == "closed" for r in served if r not in probes)
    assert refused, "every request but the probe arrived after it had closed the breaker?"
    assert len(calls(ledger)) == 3 + len(served)
    detail = (await http.get(f"{a.url}/reach/capabilities/{cap}")).json()
    assert detail["policy"]["breaker"]["status"] == "closed"


async def test_a_dead_but_registered_instance_is_ejected_then_costs_nothing(
    pair: tuple[GatewayProcess, GatewayProcess], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    gw, _ = pair
    ledger = tmp_path / "ledger.txt"
    cap = EJECTING  # ejected for 4 s
    agents = await start_agents(gw, cap, 3, "--ledger", str(ledger))
    dead = agents[0]
    dead.proc.kill()  # still registered until its heartbeat expires (30 s here)
    # Until it is ejected (3 failures in a row), a request routed there pays one failed attempt.
    paid = 0
    for _ in range(12):
        r = await invoke(http, gw, cap, "query")
        assert r.status_code == 200, r.text
        paid += len(r.json()["attempts"]) - 1
    assert paid == 3
    detail = (await http.get(f"{gw.url}/reach/capabilities/{cap}")).json()
    assert dead.instance_id in detail["policy"]["ejected"]
    before = len(calls(ledger))
    for _ in range(9):
        r = await invoke(http, gw, cap, "query")
        assert r.status_code == 200, r.text
        # One attempt each: no failed call, no backoff paid for the dead instance.
        assert len(r.json()["attempts"]) == 1
        assert r.json()["instance_id"] != dead.instance_id
    assert len(calls(ledger)) == before + 9
    # It comes back by itself: restarted, it gets traffic once the ejection ends.
    await Agent(gw, dead.instance_id, cap, "--ledger", str(ledger)).ready()

    async def served_again() -> bool:
        r = await invoke(http, gw, cap, "query")
        assert r.status_code == 200, r.text
        return bool(r.json().get("instance_id") == dead.instance_id)

    await wait_until(served_again, 15, every_s=0.05)


async def test_rate_limit_60_a_minute_per_caller_across_two_gateways(
    pair: tuple[GatewayProcess, GatewayProcess], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    a, b = pair
    ledger = tmp_path / "ledger.txt"
    cap = LIMITED  # 60 a minute per caller
    await start_agents(a, cap, 1, "--ledger", str(ledger))
    # Sequentially until the first refusal: 60 tokens to start with, one more a second, so a
    # slow box may have earned a few while it sent them.
    served = 0
    started = time.monotonic()
    while True:
        r = await invoke(http, (a, b)[served % 2], cap, "query", caller="orchestrator")
        if r.status_code != 200:
            break
        served += 1
    elapsed = time.monotonic() - started
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limited"
    assert int(r.headers["Retry-After"]) >= 1
    assert 60 <= served <= 60 + int(elapsed) + 1
    # Nothing refused reached the agent; another caller has a bucket of its own.
    assert len(calls(ledger)) == served
    r = await invoke(http, b, cap, "query", caller="someone-else")
    assert r.status_code == 200, r.text
    assert len(calls(ledger)) == served + 1
    # A repeat of a request already served calls no agent: the limit does not refuse it.
    request_id = rid()
    r = await invoke(http, a, cap, "query", caller="third", request_id=request_id)
    assert r.status_code == 200, r.text
    for _ in range(3):
        again = await invoke(http, b, cap, "query", caller="third", request_id=request_id)
        assert again.status_code == 200, again.text
        assert again.json()["result"] == r.json()["result"]


async def test_queued_requests_wait_for_a_token_and_survive_a_gateway_sigkill(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = redis_stack(
        temporal_server,
        tmp_path,
        redis_prefix,
        REACH_POLICY__RATE_LIMIT__PER_CALLER__PER_MINUTE="10",  # one token every 6 s
        REACH_POLICY__RATE_LIMIT__PER_CALLER__BURST="1",
        REACH_POLICY__RATE_LIMIT__ON_LIMIT="queue",
    )
    doomed = GatewayProcess(stack, "doomed")
    api = GatewayProcess(stack, "api", worker=False)
    survivor = Worker(stack)
    await asyncio.gather(doomed.ready(), api.ready(), survivor.ready())
    ledger = tmp_path / "ledger.txt"
    cap = f"cap-{uuid.uuid4().hex[:8]}"
    await start_agents(api, cap, 1, "--ledger", str(ledger))
    r = await invoke(http, doomed, cap, "query", caller="orchestrator")
    assert r.status_code == 200, r.text  # the one token
    # A synchronous request queues until its deadline, then 429.
    r = await invoke(http, doomed, cap, "query", caller="orchestrator", timeout_ms=1000)
    assert r.status_code == 429, r.text
    assert r.json()["waited_ms"] >= 0
    async with CallbackReceiver() as receiver:
        queued = rid()
        r = await invoke(
            http,
            doomed,
            cap,
            "query",
            caller="orchestrator",
            request_id=queued,
            callback=receiver.url,
            timeout_ms=5000,
        )
        assert r.status_code == 202, r.text
        await asyncio.sleep(1.0)
        assert calls(ledger, queued) == []  # still waiting for its token
        doomed.proc.kill()
        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        envelope = receiver.received[0][1]
        assert envelope["status"] == "success", envelope
        assert envelope["waited_ms"] >= 2000
        await asyncio.sleep(1.0)
        assert len(receiver.received) == 1
    assert len(calls(ledger, queued)) == 1


async def test_queued_requests_wait_out_a_store_outage(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """Accepted means kept: a Redis that stalls while requests wait for tokens delays them."""
    from tests.integration.test_redis_outages import RedisServer

    redis = RedisServer()
    redis.start()
    try:
        stack = new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            heartbeat_timeout=30.0,
            extra={
                **FAST,
                "REACH_REGISTRY__REDIS_URL": redis.url,
                "REACH_POLICY__RATE_LIMIT__PER_CAPABILITY__PER_MINUTE": "300",  # 5 a second
                "REACH_POLICY__RATE_LIMIT__PER_CAPABILITY__BURST": "1",
                "REACH_POLICY__RATE_LIMIT__ON_LIMIT": "queue",
            },
        )
        gw = await GatewayProcess(stack).ready()
        ledger = tmp_path / "ledger.txt"
        cap = f"cap-{uuid.uuid4().hex[:8]}"
        await start_agents(gw, cap, 1, "--ledger", str(ledger))
        async with CallbackReceiver() as receiver:
            sent = await asyncio.gather(
                *(
                    invoke(http, gw, cap, "query", callback=receiver.url, timeout_ms=60_000)
                    for _ in range(12)
                )
            )
            assert [r.status_code for r in sent] == [202] * 12
            redis.signal(signal.SIGSTOP)  # most of them are still waiting for a token
            await asyncio.sleep(3.0)
            redis.signal(signal.SIGCONT)
            await receiver.wait(12, timeout_s=60)
            statuses = Counter(envelope["status"] for _, envelope in receiver.received)
            assert statuses == {"success": 12}, [e for _, e in receiver.received]
        assert len(calls(ledger)) == 12
    finally:
        redis.stop()
