"""Prometheus metrics of one process (gateway or worker), in a registry of its own.

`ReachMetrics` holds them: the gateway serves them at `GET /metrics`, a `worker.py` process on
`metrics.worker_port` (`serve`). Names follow Prometheus' conventions (`reach_` prefix, `_total`
counters, `_seconds` histograms) and every label has a bounded set of values: capabilities and
instances as the registry knows them, operations as capabilities serve them (at most
`MAX_OPERATIONS` a capability; a caller naming more is counted under `_other`), statuses and
error types from Reach's closed vocabulary. Never a RequestID, a caller or a payload.

Counters and histograms are recorded where things happen (the gateway's door, the call
activity, the registry's hooks), each through a child made once per label set: `.labels()`
validates and takes a lock on every call, a dict lookup does not. What exists as state
elsewhere (calls in flight, breaker states, ejected instances, connection counters) is read
when Prometheus scrapes (`watch`), so the request path pays nothing for it.

Workflow code records nothing: it is replayed, and a metric would count each replay again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

if TYPE_CHECKING:
    from reach.policy.engine import PolicyEngine
    from reach.routing.inflight import InflightTracker

log = logging.getLogger("reach.metrics")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The text exposition format, version 0.0.4: what every Prometheus scrapes."""

# Seconds. A durable invoke takes ~10-20 ms on one machine, an agent call from well under
# a millisecond; timeouts reach minutes.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

MAX_CAPABILITIES = 1000
"""Distinct capabilities the invoke metrics label; more are counted under `OTHER`."""
MAX_OPERATIONS = 64
"""Distinct operations per capability the invoke metrics label; more under `OTHER`."""
MAX_CHILDREN = 10_000
"""Label sets whose child a metric keeps at hand; past it (never, with the bounds above) each
record looks its child up again, still correct."""
OTHER = "_other"
UNKNOWN = "_unknown"  # a request for a capability nobody registered: its name is the caller's

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
CONNECTION_COUNTERS = ("opened", "reused", "reconnected", "reclaimed", "failed")

# (capability, protocol) -> counter name -> count: what `connectors.ConnectionStats` holds.
ConnectionCounts = Callable[[], Mapping[tuple[str, str], Mapping[str, int]]]
# How many synchronous results were read each way ("worker", "long_poll").
ResultCounts = Callable[[], Mapping[str, int]]


M = TypeVar("M", Counter, Histogram)


class _Children(Generic[M]):
    """A metric's children by label values, each made once."""

    __slots__ = ("_children", "_metric")
    _metric: M

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._metric.labels(*values)
            if len(self._children) < MAX_CHILDREN:
                self._children[values] = child
        return child


class ReachMetrics:
    """The Reach metrics of one process, in their own `CollectorRegistry` (never the
    library's global one: several apps, or tests, in one process each have theirs)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._invokes = Counter(
            "reach_invokes",
            "Invokes answered by the gateway, by capability, operation, request status "
            "(accepted, success, error, timeout, running) and error type ('' when none).",
            ["capability", "operation", "status", "error_type"],
            registry=r,
        )
        self._invoke_seconds = Histogram(
            "reach_invoke_duration_seconds",
            "End to end: from the gateway's door until it answers (sync: the verdict; with "
            "a callback: the 202).",
            ["capability", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._accept_seconds = Histogram(
            "reach_invoke_accept_duration_seconds",
            "From the gateway's door until the request's workflow was started (requests that "
            "attached to an existing one are not counted).",
            ["capability"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._agent_call_seconds = Histogram(
            "reach_agent_call_duration_seconds",
            "One call to an agent through its protocol connector, by outcome (success, or the "
            "Reach error type it ended with).",
            ["capability", "protocol", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._retries = Counter(
            "reach_retries",
            "Agent calls made for an attempt after the first (a retry, often on another instance).",
            ["capability"],
            registry=r,
        )
        self._heartbeats = Counter(
            "reach_heartbeats",
            "Heartbeats received from registered instances, by the health they reported.",
            ["capability", "status"],
            registry=r,
        )
        self._evictions = Counter(
            "reach_evictions",
            "Instances evicted for missing heartbeats (each counted by the one process that "
            "pruned it).",
            ["capability"],
            registry=r,
        )
        self._rate_limited = Counter(
            "reach_rate_limited",
            "Requests the rate limiter held back: refused with 429 (reject) or left to wait "
            "for a token inside their workflow (queue).",
            ["capability", "outcome"],
            registry=r,
        )
        self._probes = Counter(
            "reach_probes",
            "Liveness probes of instances registered by URL (A2A agents, MCP servers), by "
            "outcome: ok, changed (what it serves), joined (back or new), or the Reach error "
            "type the probe failed with.",
            ["capability", "protocol", "outcome"],
            registry=r,
        )
        self._invoke_children: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        self._operations: dict[str, set[str]] = {}
        self._accepted = _Children(self._accept_seconds)
        self._calls = _Children(self._agent_call_seconds)
        self._retried = _Children(self._retries)
        self._beats = _Children(self._heartbeats)
        self._evicted = _Children(self._evictions)
        self._limited = _Children(self._rate_limited)
        self._probed = _Children(self._probes)
        self._live = LiveCollector()
        r.register(self._live)

    # -- recording (the request path) ---------------------------------------------------------

    def invoke(
        self, capability: str, operation: str, status: str, error_type: str, seconds: float
    ) -> None:
        """One invoke answered by the gateway, `seconds` after it came in."""
        key = (capability, operation, status, error_type)
        children = self._invoke_children.get(key)
        if children is None:
            children = self._invoke_child(key)
        children[0].inc()
        children[1].observe(seconds)

    def _invoke_child(self, key: tuple[str, str, str, str]) -> tuple[Counter, Histogram]:
        capability, operation, status, error_type = key
        capability, operation = self._bounded(capability, operation, error_type)
        children = (
            self._invokes.labels(capability, operation, status, error_type),
            self._invoke_seconds.labels(capability, status),
        )
        if len(self._invoke_children) < MAX_CHILDREN:
            self._invoke_children[key] = children
        return children

    def _bounded(self, capability: str, operation: str, error_type: str) -> tuple[str, str]:
        """Label values the caller cannot multiply: an unregistered capability's name is
        the caller's to choose, and so is an operation name."""
        if error_type == "unknown_capability":
            return UNKNOWN, UNKNOWN
        seen = self._operations.get(capability)
        if seen is None:
            if len(self._operations) >= MAX_CAPABILITIES:
                return OTHER, OTHER
            seen = self._operations[capability] = set()
        if operation not in seen:
            if len(seen) >= MAX_OPERATIONS:
                return capability, OTHER
            seen.add(operation)
        return capability, operation

    def accepted(self, capability: str, seconds: float) -> None:
        """A request's workflow started, `seconds` after the request came in."""
        self._accepted(capability).observe(seconds)

    def agent_call(self, capability: str, protocol: str, outcome: str, seconds: float) -> None:
        """A connector call ended: `outcome` is 'success' or a Reach error type."""
        self._calls(capability, protocol, outcome).observe(seconds)

    def retry(self, capability: str) -> None:
        self._retried(capability).inc()

    def heartbeat(self, capability: str, status: str) -> None:
        self._beats(capability, status).inc()

    def probe(self, capability: str, protocol: str, outcome: str) -> None:
        """A probe of an instance registered by URL ended (`gateway_api.prober`)."""
        self._probed(capability, protocol, outcome).inc()

    def evicted(self, capability: str, instance_id: str) -> None:
        """A `Registry.on_evicted` listener (the instance is not a label: counted per
        capability)."""
        self._evicted(capability).inc()

    def rate_limited(self, capability: str, outcome: str) -> None:
        """`outcome`: 'reject' (429) or 'queue' (waits inside its workflow)."""
        self._limited(capability, outcome).inc()

    # -- state read when scraped ----------------------------------------------------------------

    def watch(
        self,
        *,
        inflight: InflightTracker | None = None,
        policy: PolicyEngine | None = None,
        connections: ConnectionCounts | None = None,
        results: ResultCounts | None = None,
    ) -> None:
        """Read these at each scrape: calls in flight per instance, breaker states and ejected
        instances per capability, connection counters per capability and protocol, how
        synchronous invokes' results were read."""
        if inflight is not None:
            self._live.inflight = inflight
        if policy is not None:
            self._live.policy = policy
        if connections is not None:
            self._live.connections = connections
        if results is not None:
            self._live.results = results

    # -- exposition ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The text exposition (`CONTENT_TYPE`). Run it on the event loop's thread: the state
        read at scrape time is only ever changed there."""
        return generate_latest(self.registry)


class LiveCollector:
    """The gauges and counters whose values live elsewhere, read at scrape time."""

    def __init__(self) -> None:
        self.inflight: InflightTracker | None = None
        self.policy: PolicyEngine | None = None
        self.connections: ConnectionCounts | None = None
        self.results: ResultCounts | None = None

    def describe(self) -> Iterable[Metric]:
        inflight, breakers, ejected, connections, results = self._families()
        return [inflight, breakers, ejected, *connections, results]

    def collect(self) -> Iterable[Metric]:
        inflight, breakers, ejected, connections, results = self._families()
        if self.inflight is not None:
            for capability, counts in _inflight_counts(self.inflight).items():
                for instance_id, n in sorted(counts.items()):
                    inflight.add_metric([capability, instance_id], n)
        if self.policy is not None:
            for capability, (status, ejected_now) in _policy_states(self.policy).items():
                if status is not None:
                    breakers.add_metric([capability], BREAKER_STATES[status])
                if ejected_now is not None:
                    ejected.add_metric([capability], ejected_now)
        if self.connections is not None:
            by_name = dict(zip(CONNECTION_COUNTERS, connections, strict=True))
            for (capability, protocol), counters in sorted(self.connections().items()):
                for name, family in by_name.items():
                    family.add_metric([capability, protocol], counters.get(name, 0))
        if self.results is not None:
            for via, n in sorted(self.results().items()):
                results.add_metric([via], n)
        return [inflight, breakers, ejected, *connections, results]

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        list[CounterMetricFamily],
        CounterMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "reach_inflight_calls",
                "Agent calls in flight from this process, per instance (routing's own count, "
                "including picks not yet sent).",
                labels=["capability", "instance"],
            ),
            GaugeMetricFamily(
                "reach_breaker_state",
                "Circuit breaker per capability as this process last read it: 0 closed, "
                "1 half-open, 2 open.",
                labels=["capability"],
            ),
            GaugeMetricFamily(
                "reach_ejected_instances",
                "Instances of a capability ejected now by outlier detection, as this process "
                "last read them.",
                labels=["capability"],
            ),
            [
                CounterMetricFamily(
                    f"reach_connections_{name}",
                    f"Connections to agents {name}{_CONNECTION_NOTES[name]}, by capability "
                    "and protocol.",
                    labels=["capability", "protocol"],
                )
                for name in CONNECTION_COUNTERS
            ],
            CounterMetricFamily(
                "reach_sync_results",
                "Synchronous invokes' results, by how the gateway read them: 'worker' as its "
                "own invoke worker completed the workflow and Temporal accepted it, 'long_poll' "
                "from the workflow's history (a repeat, a start that was not eager, a refused "
                "completion, a call still running after 10 s).",
                labels=["via"],
            ),
        )


_CONNECTION_NOTES = {
    "opened": "",
    "reused": " (a call on a connection already open)",
    "reconnected": " (a broken connection replaced)",
    "reclaimed": " (closed when idle, over the bound, or its instance left)",
    "failed": " (could not connect)",
}


def _inflight_counts(tracker: InflightTracker) -> dict[str, dict[str, int]]:
    """This process's own calls per capability and instance (not the other processes' it
    reads from Redis: each process reports its own, and Prometheus sums them)."""
    return tracker.own_counts()


def _policy_states(engine: PolicyEngine) -> dict[str, tuple[str | None, int | None]]:
    """capability -> (breaker status, instances ejected now) from the views this process
    holds; None where that part is disabled. Each read asks for a background refresh of a
    view older than the engine's interval, so an idle capability's state is not left behind
    (seen by the next scrape)."""
    out: dict[str, tuple[str | None, int | None]] = {}
    for capability, view in engine.held_views().items():
        with contextlib.suppress(RuntimeError):  # no running loop (a unit test): as held
            engine.recent_view(capability)
        settings = engine.settings
        breaker = view.breaker.status if settings.breaker_for(capability).enabled else None
        ejected = (
            len(engine.ejected(capability, view))
            if settings.outlier_for(capability).enabled
            else None
        )
        out[capability] = (breaker, ejected)
    return out


# -- a worker's metrics port ------------------------------------------------------------------

READ_TIMEOUT_S = 5.0
MAX_REQUEST_HEAD = 16 * 1024


async def serve(metrics: ReachMetrics, host: str, port: int) -> asyncio.Server:
    """Serve `GET /metrics` on host:port (0: a free port; the server's sockets say which).

    A few lines of asyncio rather than `prometheus_client.start_http_server`: that one
    scrapes on a thread of its own, while the state read at scrape time is changed by this
    event loop only, so the scrape runs here too. One request per connection, no TLS, no
    authentication: bind it to an internal address.
    """

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method not in (b"GET", b"HEAD"):
                status, body, kind = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path != b"/metrics":
                status, body, kind = "404 Not Found", b"see /metrics\n", "text/plain"
            else:
                status, body, kind = "200 OK", metrics.exposition(), CONTENT_TYPE
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a client that went away or sent no request: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.start_server(answer, host, port, limit=MAX_REQUEST_HEAD)


__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "ConnectionCounts",
    "LiveCollector",
    "ReachMetrics",
    "serve",
]
