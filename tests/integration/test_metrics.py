"""Metrics from real processes: a gateway's GET /metrics after real invokes through a real agent,
a retry, a token-guarded scrape, and a `worker.py` process serving its own on its port."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_api.devserver import free_port
from reach.security.tokens import FileTokenStore, issue
from reach.telemetry.metrics import CONTENT_TYPE, UNKNOWN
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, Worker, wait_until

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(http: httpx.AsyncClient, url: str, **headers: str) -> Samples:
    r = await http.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` carrying at least these labels."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


# The limiter test's capability: its own rate limit (`policy.capabilities`), so it shares the
# module gateway instead of starting one of its own.
LIMITED = f"limited-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """The module's gateway (memory registry, reach.yaml's policy); LIMITED allows one call a
    minute per caller."""
    limited = {LIMITED: {"rate_limit": {"per_caller": {"per_minute": 1, "burst": 1}}}}
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("metrics"),
        extra={"REACH_POLICY__CAPABILITIES": json.dumps(limited)},
    )
    async with GatewayProcess(stack) as gw:
        yield gw


async def test_invokes_heartbeats_and_connections_are_counted(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await Agent(gateway, f"{capability}-01", capability).ready()
    before = await scrape(http, gateway.url)
    body = {"target": capability, "operation": "query", "payload": {"q": "x"}}
    ids = []
    for _ in range(3):
        r = await http.post(f"{gateway.url}/reach/invoke", json=body)
        assert r.status_code == 200, r.text
        ids.append(r.json()["request_id"])
    r = await http.post(f"{gateway.url}/reach/invoke", json={**body, "target": "no-such-cap"})
    assert r.status_code == 404, r.text
    after = await scrape(http, gateway.url)

    ok = {"capability": capability, "operation": "query", "status": "success", "error_type": ""}
    assert get(after, "reach_invokes_total", **ok) == 3
    e2e = {"capability": capability, "status": "success"}
    assert get(after, "reach_invoke_duration_seconds_count", **e2e) == 3
    assert get(after, "reach_invoke_duration_seconds_bucket", **e2e, le="+Inf") == 3
    assert 0 < get(after, "reach_invoke_duration_seconds_sum", **e2e) < 30
    accept = {"capability": capability}
    assert get(after, "reach_invoke_accept_duration_seconds_count", **accept) == 3
    call = {"capability": capability, "protocol": "http", "outcome": "success"}
    assert get(after, "reach_agent_call_duration_seconds_count", **call) == 3
    unknown = {
        "capability": UNKNOWN,
        "operation": UNKNOWN,
        "status": "error",
        "error_type": "unknown_capability",
    }
    assert (
        get(after, "reach_invokes_total", **unknown) - get(before, "reach_invokes_total", **unknown)
        == 1
    )

    # The agent heartbeats every 0.5 s; its connection was opened once, then reused.
    async def beating() -> bool:
        samples = await scrape(http, gateway.url)
        return get(samples, "reach_heartbeats_total", capability=capability, status="ok") > 0

    await wait_until(beating, timeout_s=5)
    conn = {"capability": capability, "protocol": "http"}
    assert get(after, "reach_connections_opened_total", **conn) >= 1
    opened_or_reused = get(after, "reach_connections_opened_total", **conn) + get(
        after, "reach_connections_reused_total", **conn
    )
    assert opened_or_reused >= 3
    assert ("reach_connections_failed_total", frozenset(conn.items())) in after
    assert get(after, "reach_retries_total", capability=capability) == 0
    # Nothing in flight once every call is answered; no RequestID is ever a label value.
    assert total(after, "reach_inflight_calls", capability=capability) == 0
    values = {v for _, labels in after for _, v in labels}
    assert not values & set(ids)
    # A repeat of an existing request_id naming made-up capabilities (a 409) must not mint
    # label values: every name nobody registered is counted as _unknown.
    for i in range(5):
        junk = {**body, "target": f"junk-{uuid.uuid4().hex[:8]}-{i}", "request_id": ids[0]}
        r = await http.post(f"{gateway.url}/reach/invoke", json=junk)
        assert r.status_code == 409, r.text
    later = await scrape(http, gateway.url)
    assert not any("junk-" in v for _, labels in later for _, v in labels)
    conflict = {**unknown, "error_type": "request_conflict"}
    assert get(later, "reach_invokes_total", **conflict) >= 5


async def test_a_retry_and_the_failed_call_are_counted(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    # The agent fails its first call (503, retryable); the keyed request is retried.
    await Agent(gateway, f"{capability}-01", capability, "--fail-first", "1").ready()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={
            "target": capability,
            "operation": "query",
            "payload": {},
            "idempotency_key": uuid.uuid4().hex,
            "timeout_ms": 10_000,
        },
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["attempts"]) == 2
    after = await scrape(http, gateway.url)
    assert get(after, "reach_retries_total", capability=capability) == 1
    outcome = {"capability": capability, "protocol": "http"}
    assert get(after, "reach_agent_call_duration_seconds_count", **outcome, outcome="agent_error")
    assert get(after, "reach_agent_call_duration_seconds_count", **outcome, outcome="success") == 1


async def test_metrics_need_a_token_once_tokens_are_required(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    token, record = issue("prometheus", "caller")
    FileTokenStore(tmp_path / "tokens.json").write(record)
    gateway = await GatewayProcess(new_stack(temporal_server, tmp_path)).ready()
    r = await http.get(f"{gateway.url}/metrics")
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "unauthorized"
    wrong = await http.get(f"{gateway.url}/metrics", headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    r = await http.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    assert "# TYPE reach_invokes_total counter" in r.text
    # The document says so too.
    spec = (await http.get(f"{gateway.url}/openapi.json")).json()
    responses = spec["paths"]["/metrics"]["get"]["responses"]
    assert {"200", "401"} <= set(responses)
    assert "text/plain" in responses["200"]["content"]


async def test_a_queue_worker_serves_its_own_metrics(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """`worker.py --capability X --metrics-port P`: the queue-mode call runs in the worker,
    and the worker's port shows it (the gateway's does not)."""
    capability = f"gen-{uuid.uuid4().hex[:6]}"
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        extra={"REACH_CAPABILITIES": f'{{"{capability}": {{"mode": "queue"}}}}'},
    )
    gateway = GatewayProcess(stack)
    port = free_port()
    worker = Worker(stack, "--capability", capability, "--metrics-port", str(port))
    await asyncio.gather(gateway.ready(), worker.ready())  # both start at once
    await Agent(gateway, f"{capability}-01", capability).ready()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in worker.proc.output()
    url = f"http://127.0.0.1:{port}"
    body = {"target": capability, "operation": "query", "payload": {}, "timeout_ms": 10_000}
    for _ in range(2):
        r = await http.post(f"{gateway.url}/reach/invoke", json=body)
        assert r.status_code == 200, r.text

    call = {"capability": capability, "protocol": "http", "outcome": "success"}

    async def counted() -> bool:
        return get(await scrape(http, url), "reach_agent_call_duration_seconds_count", **call) == 2

    await wait_until(counted, timeout_s=10)
    on_worker = await scrape(http, url)
    assert get(on_worker, "reach_connections_opened_total", capability=capability, protocol="http")
    on_gateway = await scrape(http, gateway.url)
    assert get(on_gateway, "reach_agent_call_duration_seconds_count", **call) == 0
    ok = {"capability": capability, "operation": "query", "status": "success", "error_type": ""}
    assert get(on_gateway, "reach_invokes_total", **ok) == 2
    assert (await http.get(f"{url}/nothing")).status_code == 404


async def test_limiter_refusals_are_counted(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    capability = LIMITED
    await Agent(gateway, f"{capability}-01", capability).ready()
    body = {"target": capability, "operation": "query", "payload": {}}
    assert (await http.post(f"{gateway.url}/reach/invoke", json=body)).status_code == 200
    r = await http.post(f"{gateway.url}/reach/invoke", json=body)
    assert r.status_code == 429, r.text
    samples = await scrape(http, gateway.url)
    assert get(samples, "reach_rate_limited_total", capability=capability, outcome="reject") == 1
    limited = {
        "capability": capability,
        "operation": "query",
        "status": "error",
        "error_type": "rate_limited",
    }
    assert get(samples, "reach_invokes_total", **limited) == 1
    e2e = {"capability": capability, "status": "error"}
    assert get(samples, "reach_invoke_duration_seconds_count", **e2e) == 1
