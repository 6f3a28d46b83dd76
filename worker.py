"""Temporal worker entry point and the wiring the gateway shares.

    python worker.py                              # invoke worker: workflows + inline calls
    python worker.py --capability content-generator   # serves reach-cap-content-generator
    python worker.py --invoke --capability a --capability b

The gateway process runs the invoke worker too (eager start needs the worker on the starting
client); extra `worker.py` processes add capacity and take over requests from a crashed one.
Several processes need the shared registry: `REACH_REGISTRY__TYPE=redis`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, Interceptor
from temporalio.envconfig import ClientConfig
from temporalio.service import RPCError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import ReachActivities
from activities.codec import data_converter
from activities.telemetry import RequestIdInterceptor, temporal_tracing
from connectors import ConnectorSet
from reach.config import ConfigError, ReachSettings, TemporalSettings
from reach.errors import ReachError
from reach.policy.engine import PolicyEngine
from reach.policy.state import create_policy_state
from reach.process import configure_logging, exit_now, run, settle_heap
from reach.registry import Registry
from reach.registry.view import RegistryView
from reach.routing import Router, check_routing
from reach.routing.inflight import create_inflight
from reach.security.audit import AuditLog
from reach.settings_checks import load_checked_settings
from reach.store import Store, create_store
from reach.telemetry import metrics as reach_metrics
from reach.telemetry import tracing
from workflows.callback import DeliverCallbackWorkflow
from workflows.invoke import SEARCH_ATTRIBUTES, InvokeWorkflow, capability_queue

log = logging.getLogger("reach.worker")
# Threads that run workflow activations when they are not run inline (the sandbox, or
# temporal.inline_activations off). They take the GIL in turn anyway, and the SDK's default (one
# per concurrent task) makes them contend for it: 2 served 122 calls/s at 64 in flight where the
# default served 88 (bench/invoke.py, reach inline).
WORKFLOW_THREADS = 2


def telemetry_interceptors(settings: ReachSettings) -> list[Interceptor]:
    """On the client, so that every worker built on it has them too: Temporal's OpenTelemetry
    interceptor when `telemetry.traces` is on (its start, query and update spans on the client
    only: `temporal_tracing`), and the RequestID on activities' log records with JSON logs. None
    by default: tracing off costs nothing."""
    found: list[Interceptor] = []
    active = tracing.configure(settings.telemetry)
    if active is not None:
        found.append(temporal_tracing(active))
    if settings.telemetry.logs_format == "json":
        found.append(RequestIdInterceptor())
    return found


async def connect_temporal(settings: ReachSettings, *, wait_s: float = 0.0) -> Client:
    """Connect with the standard TEMPORAL_* variables winning over reach.yaml's `temporal:`."""
    config = ClientConfig.load_client_connect_config()
    config.setdefault("target_host", settings.temporal.address)
    config.setdefault("namespace", settings.temporal.namespace)
    # Payloads encrypted when security.encryption is on: the gateway and every worker
    # connect here, so they all read and write history the same way.
    converter = data_converter(settings)
    deadline = asyncio.get_running_loop().time() + wait_s
    announced = False
    while True:
        try:
            return await Client.connect(
                **config, data_converter=converter, interceptors=telemetry_interceptors(settings)
            )
        except RuntimeError as exc:
            if not announced and wait_s > 0:
                log.warning(
                    "waiting up to %.0fs for Temporal at %s ...", wait_s, config["target_host"]
                )
                announced = True
            if asyncio.get_running_loop().time() >= deadline:
                raise ConnectionError(
                    f"cannot connect to Temporal at {config['target_host']} "
                    f"(namespace {config['namespace']}): {exc}. Is the server running? "
                    "`reach up` starts one; otherwise set TEMPORAL_ADDRESS."
                ) from exc
            await asyncio.sleep(0.25)


async def ensure_search_attributes(client: Client, namespace: str) -> None:
    """Register the Reach search attributes if the cluster lacks them (the dev server has them)."""
    ops = client.operator_service
    try:
        existing = await ops.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
        missing = {
            key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
            for key in SEARCH_ATTRIBUTES
            if key.name not in existing.custom_attributes
        }
        if missing:
            await ops.add_search_attributes(
                AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
            )
            log.info("registered search attributes %s", sorted(missing))
    except RPCError as exc:
        # Temporal Cloud and locked-down clusters refuse this; the operator registers them.
        log.warning("could not check/register search attributes: %s", exc)


async def announce_retention(client: Client, namespace: str) -> None:
    """Say how long a RequestID stays deduplicated: as long as the namespace keeps the request.

    After a closed workflow passes its namespace's retention, Temporal deletes it, and the same
    RequestID would start a new request.
    """
    try:
        desc = await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace)
        )
    except RPCError as exc:
        log.warning("could not read namespace %s's retention: %s", namespace, exc)
        return
    hours = desc.config.workflow_execution_retention_ttl.ToTimedelta().total_seconds() / 3600
    log.info(
        "a RequestID is deduplicated until its request has been closed for %.0f h "
        "(namespace %s retention; longer: temporal.dev_server.retention_hours, or the "
        "cluster's namespace settings)",
        hours,
        namespace,
    )


@dataclass
class Services:
    """What activities need, built once per process and closed together."""

    settings: ReachSettings
    store: Store
    registry: Registry
    view: RegistryView
    router: Router
    connectors: ConnectorSet
    activities: ReachActivities
    metrics: reach_metrics.ReachMetrics | None = None  # None: metrics.enabled is false

    async def start(self) -> None:
        """Read the registry into the local view and start following it (and the in-flight
        counts shared with other processes)."""
        await self.view.start()
        await self.router.inflight.start()

    async def aclose(self) -> None:
        await self.view.aclose()
        await self.router.inflight.aclose()
        await self.activities.aclose()
        await self.connectors.aclose()
        await self.store.aclose()


def build_services(
    settings: ReachSettings, *, sweep: bool = True, in_gateway: bool = True
) -> Services:
    """Everything an invoke needs in this process (call `start()` in its event loop). An
    unknown routing strategy in the configuration is a ConfigError here. `sweep`: prune
    evicted instances every second (gateways do; a capability worker need not).
    Where agents reach Reach back (A2A push notifications): `in_gateway`, this process's own
    gateway address (`settings.gateway_url`); else `push_url_of` (public_url, or none)."""
    store = create_store(settings.registry)
    registry = Registry(store, settings.registry, settings.transport)
    view = RegistryView(
        registry,
        resync_s=settings.routing.view_resync_s,
        sweep_s=min(1.0, settings.registry.heartbeat_interval) if sweep else None,
    )

    async def live_instances(capability: str) -> set[str] | None:
        try:
            snap = await view.snapshot(capability)
        except ReachError:  # the store is away: keep connections until it can say
            return None
        return {e.instance_id for e in snap.entries} if snap else set()

    connectors = ConnectorSet(
        settings.transport,
        live_instances=live_instances,
        security=settings.security,
        gateway_url=settings.gateway_url if in_gateway else push_url_of(settings),
    )
    check_routing(settings)
    inflight = create_inflight(
        store,
        lease_s=settings.routing.inflight_lease_s,
        refresh_s=settings.routing.inflight_refresh_ms / 1000,
    )
    router = Router.from_settings(settings, inflight)
    view.on_removed(inflight.forget)  # an instance that left leaves no latency entry behind
    policy = PolicyEngine(settings.policy, create_policy_state(store))
    metrics = None
    if settings.metrics.enabled:
        metrics = reach_metrics.ReachMetrics()
        metrics.watch(
            inflight=inflight, policy=policy, connections=lambda: connection_counts(connectors)
        )
        registry.on_evicted(metrics.evicted)
    activities = ReachActivities(
        registry,
        router,
        connectors,
        policy,
        view=view,
        security=settings.security,
        metrics=metrics,
    )
    return Services(settings, store, registry, view, router, connectors, activities, metrics)


def connection_counts(connectors: ConnectorSet) -> dict[tuple[str, str], dict[str, int]]:
    """The connectors' lifecycle counters, (capability, protocol) -> counter -> value, read
    (never changed) for the metrics."""
    return connectors.stats.snapshot()


def build_workers(
    client: Client,
    services: Services,
    *,
    invoke: bool = True,
    capabilities: Sequence[str] = (),
) -> list[Worker]:
    acts = services.activities
    acts.client = client
    workers: list[Worker] = []
    if invoke:
        sandbox = services.settings.temporal.workflow_sandbox
        workers.append(
            Worker(
                client,
                task_queue=services.settings.temporal.task_queue,
                workflows=[InvokeWorkflow, DeliverCallbackWorkflow],
                activities=[
                    acts.resolve,
                    acts.call,
                    acts.deliver_callback,
                    acts.claim_key,
                    acts.release_key,
                    acts.release_route,
                    acts.pinned,
                    acts.pinned_attempt,
                    acts.follow,
                    acts.take_token,
                    acts.follow_task,
                    acts.cancel_task,
                ],
                # OpenTelemetry passed through, as Temporal's own OTel plugin does: one context
                # inside and out (the trace ids on the workflow's log records).
                workflow_runner=SandboxedWorkflowRunner(
                    restrictions=SandboxRestrictions.default.with_passthrough_modules(
                        "opentelemetry"
                    )
                )
                if sandbox
                else UnsandboxedWorkflowRunner(),
                workflow_task_executor=ThreadPoolExecutor(
                    WORKFLOW_THREADS, thread_name_prefix="reach-workflow"
                ),
                # The SDK's debug mode is what runs activations inline on this event loop (its
                # other effects: no deadlock timeout, and a breakpoint() hook for workflows).
                debug_mode=inline_activations(services.settings.temporal),
                sticky_queue_schedule_to_start_timeout=timedelta(
                    seconds=services.settings.temporal.sticky_schedule_to_start_s
                ),
            )
        )
    for capability in capabilities:
        workers.append(
            Worker(
                client,
                task_queue=capability_queue(capability),
                activities=[acts.resolve, acts.call, acts.follow_task, acts.cancel_task],
            )
        )
    return workers


def inline_activations(temporal: TemporalSettings) -> bool:
    """Whether the invoke worker runs activations on its event loop (`inline_activations`);
    never in the sandbox, which the SDK's debug mode would relax."""
    return temporal.inline_activations and not temporal.workflow_sandbox


@contextlib.asynccontextmanager
async def running_workers(workers: Sequence[Worker]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield
    finally:
        await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)
        # The SDK's native threads can still be tearing down; let them finish before exit.
        await asyncio.sleep(0.5)


async def serve(settings: ReachSettings, *, invoke: bool, capabilities: Sequence[str]) -> None:
    client = await connect_temporal(settings, wait_s=settings.temporal.connect_wait_s)
    await ensure_search_attributes(client, client.namespace)
    await announce_retention(client, client.namespace)
    # Evictions are pruned by the gateways (and by an invoke worker); capability workers
    # only follow the registry.
    services = build_services(settings, sweep=invoke, in_gateway=False)
    await services.start()
    audit = AuditLog(settings.audit)  # callback requests' outcome records, as the gateway's
    await audit.start()
    services.activities.audit = audit
    workers = build_workers(client, services, invoke=invoke, capabilities=capabilities)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    queues = [w.task_queue for w in workers]
    log.info(
        "worker serving task queues %s on %s", queues, client.service_client.config.target_host
    )
    scrape = await serve_metrics(services)
    print(f"reach worker: serving {', '.join(queues)}", flush=True)
    async with running_workers(workers):
        settle_heap()
        await stop.wait()
    if scrape is not None:
        scrape.close()
    await audit.aclose()
    await services.aclose()


def push_url_of(settings: ReachSettings) -> str | None:
    """The gateway URL a worker apart from its gateways gives A2A agents for their push
    notifications: `public_url` alone (the listen address is a gateway's, not this process's,
    and may be another host's or another stack's). None, said once at start, when push is
    possible (a webhook key) but no URL is set: that worker's A2A tasks are followed by polling."""
    if settings.public_url:
        url = settings.public_url.rstrip("/")
        if settings.security.webhook_key is not None:
            log.info("A2A push notifications to this worker's tasks go to %s", url)
        return url
    if settings.security.webhook_key is not None:
        log.warning(
            "A2A push notifications off in this worker: public_url (REACH_PUBLIC_URL) is not "
            "set, so the A2A agents it calls are sent no push config and their tasks are "
            "followed by polling; set it to a URL the agents reach a gateway at"
        )
    return None


async def serve_metrics(services: Services) -> asyncio.Server | None:
    """GET /metrics on `metrics.worker_port`, when that is set (None: not served)."""
    settings = services.settings.metrics
    if services.metrics is None or settings.worker_port is None:
        return None
    try:
        server = await reach_metrics.serve(
            services.metrics, settings.worker_host, settings.worker_port
        )
    except OSError as exc:
        raise ConfigError(
            f"metrics.worker_port: cannot listen on {settings.worker_host}:"
            f"{settings.worker_port}: {exc.strerror or exc}"
        ) from exc
    host, port = server.sockets[0].getsockname()[:2]
    log.info("metrics on http://%s:%s/metrics", host, port)
    print(f"reach worker: metrics on http://{host}:{port}/metrics", flush=True)
    return server


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="worker.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", help="path to reach.yaml (default: $REACH_CONFIG or ./reach.yaml)"
    )
    parser.add_argument(
        "--capability",
        action="append",
        default=[],
        metavar="NAME",
        help="serve task queue reach-cap-NAME (repeatable)",
    )
    parser.add_argument(
        "--invoke",
        action="store_true",
        help="also run the invoke worker (implied when no --capability is given)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve GET /metrics on this port (0: a free one; default: metrics.worker_port)",
    )
    args = parser.parse_args(argv)
    configure_logging()
    try:
        settings = load_checked_settings(args.config)
        if args.metrics_port is not None:
            settings.metrics.worker_port = args.metrics_port
        configure_logging(telemetry=settings.telemetry)
        invoke = args.invoke or not args.capability
        run(serve(settings, invoke=invoke, capabilities=args.capability), settings)
    except (ConfigError, ConnectionError) as exc:
        exit_now(1, f"error: {exc}")
    except KeyboardInterrupt:
        pass
    exit_now(0)


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is no port (0-65535)")
    return port


if __name__ == "__main__":
    main()
