"""The Prometheus metrics of a process: names and labels by Prometheus' conventions, bounded
label values, counters that move, state read at scrape time from the real in-flight tracker,
policy engine and connection counters, a worker's metrics port, the shipped Grafana dashboard."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families

from connectors import ConnectionStats
from reach.config import CircuitBreakerSettings, OutlierSettings, PolicySettings
from reach.policy.engine import PolicyEngine
from reach.policy.state import MemoryPolicyState
from reach.routing.inflight import InflightTracker
from reach.telemetry import metrics as reach_metrics
from reach.telemetry.metrics import MAX_OPERATIONS, OTHER, UNKNOWN, ReachMetrics
from worker import connection_counts

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "agent-reach.json"
REQUEST_ID = "req-6f1c2a9e4b7d4e0f"
CLOCK = [1000.0]  # the policy state's clock (seconds), moved by the tests

# Every label a Reach metric may carry: each has a bounded set of values.
LABELS = {"capability", "operation", "status", "error_type", "protocol", "outcome", "instance"}


def families(m: ReachMetrics) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}


def value(m: ReachMetrics, sample: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def sample_names(m: ReachMetrics) -> set[str]:
    """Every series name the registry can expose (histogram and counter suffixes included)."""
    names: set[str] = set()
    for family in m.registry.collect():
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "count", "sum", "created")}
        else:
            names.add(family.name)
    return names


async def busy_metrics() -> tuple[ReachMetrics, InflightTracker, PolicyEngine, ConnectionStats]:
    """Metrics with something recorded in each, and the live sources they read."""
    m = ReachMetrics()
    tracker = InflightTracker()
    engine = PolicyEngine(
        PolicySettings(
            circuit_breaker=CircuitBreakerSettings(error_threshold=2, open_duration_ms=60_000),
            outlier=OutlierSettings(consecutive_failures=2),
        ),
        MemoryPolicyState(clock=lambda: CLOCK[0]),
    )
    stats = ConnectionStats()

    class Connectors:  # what `worker.connection_counts` reads of a ConnectorSet
        def __init__(self) -> None:
            self.stats = stats

    m.watch(
        inflight=tracker,
        policy=engine,
        connections=lambda: connection_counts(Connectors()),  # type: ignore[arg-type]
    )
    m.invoke("cap", "query", "success", "", 0.012)
    m.invoke("cap", "query", "error", "agent_error", 0.2)
    m.accepted("cap", 0.004)
    m.agent_call("cap", "http", "success", 0.001)
    m.retry("cap")
    m.heartbeat("cap", "ok")
    m.evicted("cap", "cap-01")
    m.probe("cap", "a2a", "ok")
    m.rate_limited("cap", "reject")
    tracker.begin("cap", "cap-01", f"{REQUEST_ID}:1")
    for _ in range(2):
        await engine.record("cap", "cap-02", ok=False, probe=False)
    stats.count("cap", "http", "opened")
    stats.count("cap", "http", "reused", 4)
    return m, tracker, engine, stats


async def test_names_and_labels_follow_prometheus_conventions() -> None:
    m, *_ = await busy_metrics()
    found = families(m)
    assert found, "nothing exposed"
    for name, family in found.items():
        assert name.startswith("reach_"), name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        if family.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: a histogram of durations, in seconds"
        if family.type == "counter":
            assert not name.endswith("_total"), f"{name}: the library adds _total"
            totals = [s for s in family.samples if not s.name.endswith("_created")]
            assert all(s.name == f"{name}_total" for s in totals), name
        if family.type == "gauge":
            assert not name.endswith(("_total", "_count", "_sum")), name
        for s in family.samples:
            assert set(s.labels) - {"le"} <= LABELS, f"{s.name}: {sorted(s.labels)}"
            assert REQUEST_ID not in s.labels.values(), s
    expected = {
        "reach_invokes": "counter",
        "reach_invoke_duration_seconds": "histogram",
        "reach_invoke_accept_duration_seconds": "histogram",
        "reach_agent_call_duration_seconds": "histogram",
        "reach_retries": "counter",
        "reach_heartbeats": "counter",
        "reach_evictions": "counter",
        "reach_probes": "counter",
        "reach_rate_limited": "counter",
        "reach_inflight_calls": "gauge",
        "reach_breaker_state": "gauge",
        "reach_ejected_instances": "gauge",
        **{f"reach_connections_{n}": "counter" for n in reach_metrics.CONNECTION_COUNTERS},
    }
    assert {name: found[name].type for name in expected if name in found} == expected


async def test_counters_and_histograms_move() -> None:
    m, *_ = await busy_metrics()
    labels = {"capability": "cap", "operation": "query", "status": "success", "error_type": ""}
    assert value(m, "reach_invokes_total", **labels) == 1
    for _ in range(3):
        m.invoke("cap", "query", "success", "", 0.01)
    assert value(m, "reach_invokes_total", **labels) == 4
    assert value(m, "reach_invoke_duration_seconds_count", capability="cap", status="success") == 4
    assert value(m, "reach_invoke_duration_seconds_sum", capability="cap", status="success") == (
        pytest.approx(0.042)
    )
    # 0.01 falls in the 0.01 bucket (le is inclusive), 0.012 above it.
    bucket = {"capability": "cap", "status": "success", "le": "0.01"}
    assert value(m, "reach_invoke_duration_seconds_bucket", **bucket) == 3
    assert (
        value(
            m,
            "reach_invokes_total",
            capability="cap",
            operation="query",
            status="error",
            error_type="agent_error",
        )
        == 1
    )
    assert value(m, "reach_invoke_accept_duration_seconds_count", capability="cap") == 1
    call = {"capability": "cap", "protocol": "http", "outcome": "success"}
    assert value(m, "reach_agent_call_duration_seconds_count", **call) == 1
    assert value(m, "reach_retries_total", capability="cap") == 1
    assert value(m, "reach_heartbeats_total", capability="cap", status="ok") == 1
    assert value(m, "reach_evictions_total", capability="cap") == 1
    assert value(m, "reach_rate_limited_total", capability="cap", outcome="reject") == 1


async def test_live_state_is_read_at_scrape_time() -> None:
    m, tracker, engine, stats = await busy_metrics()
    assert value(m, "reach_inflight_calls", capability="cap", instance="cap-01") == 1
    # Two failures in a row: the breaker opened (2) and the failing instance was ejected.
    assert value(m, "reach_breaker_state", capability="cap") == 2
    assert value(m, "reach_ejected_instances", capability="cap") == 1
    assert value(m, "reach_connections_opened_total", capability="cap", protocol="http") == 1
    assert value(m, "reach_connections_reused_total", capability="cap", protocol="http") == 4
    assert value(m, "reach_connections_failed_total", capability="cap", protocol="http") == 0
    # The next scrape sees the sources as they are then.
    call = tracker.begin("cap", "cap-01")
    stats.count("cap", "http", "reused")
    assert value(m, "reach_inflight_calls", capability="cap", instance="cap-01") == 2
    assert value(m, "reach_connections_reused_total", capability="cap", protocol="http") == 5
    tracker.end(call)
    assert value(m, "reach_inflight_calls", capability="cap", instance="cap-01") == 1
    CLOCK[0] += 61  # past open_duration_ms: the next read finds it half-open
    await engine.view("cap", fresh=True)
    assert value(m, "reach_breaker_state", capability="cap") == 1
    await engine.record("cap", "cap-02", ok=True, probe=True)  # a probe's success closes it
    assert value(m, "reach_breaker_state", capability="cap") == 0


async def test_a_disabled_breaker_or_outlier_reports_nothing() -> None:
    m = ReachMetrics()
    engine = PolicyEngine(
        PolicySettings(
            circuit_breaker=CircuitBreakerSettings(enabled=False),
            outlier=OutlierSettings(consecutive_failures=1),
        ),
        MemoryPolicyState(),
    )
    m.watch(policy=engine)
    await engine.record("cap", "a", ok=False, probe=False)
    assert value(m, "reach_breaker_state", capability="cap") is None
    assert value(m, "reach_ejected_instances", capability="cap") == 1


def test_label_values_callers_choose_are_bounded() -> None:
    m = ReachMetrics()
    for i in range(MAX_OPERATIONS + 50):
        m.invoke("cap", f"op-{i}", "error", "agent_error", 0.001)
    ops = {
        s.labels["operation"]
        for f in text_string_to_metric_families(m.exposition().decode())
        if f.name == "reach_invokes"
        for s in f.samples
        if s.name == "reach_invokes_total"
    }
    assert len(ops) == MAX_OPERATIONS + 1
    assert OTHER in ops
    other = {"capability": "cap", "operation": OTHER, "status": "error"}
    assert value(m, "reach_invokes_total", **other, error_type="agent_error") == 50
    # A capability nobody registered: its name is not a label value.
    for i in range(20):
        m.invoke(f"nobody-{i}", "query", "error", "unknown_capability", 0.001)
    unknown = {"capability": UNKNOWN, "operation": UNKNOWN, "status": "error"}
    assert value(m, "reach_invokes_total", **unknown, error_type="unknown_capability") == 20
    assert not any("nobody" in line for line in m.exposition().decode().splitlines())


def test_each_label_set_is_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`.labels()` validates and locks on every call: the hot path keeps its children."""
    m = ReachMetrics()
    looked_up: list[tuple[str, ...]] = []
    for metric in (m._invokes, m._invoke_seconds, m._agent_call_seconds, m._accept_seconds):
        original = metric.labels

        def counting(*values: str, _original=original) -> object:  # type: ignore[no-untyped-def]
            looked_up.append(values)
            return _original(*values)

        monkeypatch.setattr(metric, "labels", counting)
    for _ in range(100):
        m.invoke("cap", "query", "success", "", 0.01)
        m.agent_call("cap", "http", "success", 0.001)
        m.accepted("cap", 0.002)
    assert len(looked_up) == 4  # counter + end-to-end, agent call, accept: once each


def test_recording_costs_microseconds() -> None:
    """The measured cost is ~2 us for an invoke (counter + histogram) and ~1.4 us for a
    histogram alone; a bound 25x looser only catches a lost child cache or worse."""
    m = ReachMetrics()
    n = 10_000
    start = time.perf_counter()
    for _ in range(n):
        m.invoke("cap", "query", "success", "", 0.012)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per recorded invoke"


def test_registries_are_separate() -> None:
    a, b = ReachMetrics(), ReachMetrics()
    a.retry("cap")
    assert value(a, "reach_retries_total", capability="cap") == 1
    assert value(b, "reach_retries_total", capability="cap") is None


def test_the_exposition_is_text_format_0_0_4() -> None:
    assert reach_metrics.CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


async def test_a_worker_serves_its_metrics_on_its_port() -> None:
    m = ReachMetrics()
    m.retry("cap")
    server = await reach_metrics.serve(m, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            r = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"] == reach_metrics.CONTENT_TYPE
            assert 'reach_retries_total{capability="cap"} 1.0' in r.text
            assert (await http.get(f"http://127.0.0.1:{port}/metrics?x=1")).status_code == 200
            head = await http.head(f"http://127.0.0.1:{port}/metrics")
            assert head.status_code == 200
            assert head.content == b""
            assert (await http.get(f"http://127.0.0.1:{port}/")).status_code == 404
            assert (await http.post(f"http://127.0.0.1:{port}/metrics")).status_code == 405
    finally:
        server.close()
        await server.wait_closed()


def test_the_grafana_dashboard_uses_only_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "Agent-Reach"
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    used = {name for expr in exprs for name in re.findall(r"\breach_[a-z0-9_]+", expr)}
    known = sample_names(ReachMetrics())
    assert used, "the dashboard queries no Reach metric"
    assert used <= known, f"not exposed by Reach: {sorted(used - known)}"
    # Every metric is on the dashboard somewhere.
    bases = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in used}
    exposed = {family.name for family in ReachMetrics().registry.collect()}
    assert exposed <= bases, f"not on the dashboard: {sorted(exposed - bases)}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
