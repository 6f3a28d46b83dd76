"""The FastAPI application factory. Nothing is built at import time:
`create_app(settings, client)` wires everything in the lifespan, so tests and several
processes configure their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send
from temporalio.client import Client

import reach
from gateway_api import a2a_front, browsers, grpc_front
from gateway_api.a2a_front import A2AFastPath, is_a2a_call
from gateway_api.beats_fast import HeartbeatFastPath, heartbeat_of
from gateway_api.errors import BodyLimit, CatchBugs, install_error_handlers
from gateway_api.fast import InvokeFastPath, is_invoke
from gateway_api.gateway import Gateway
from gateway_api.http_limits import DRAINING
from gateway_api.mcp_front import McpFront, is_mcp
from gateway_api.prober import Prober
from gateway_api.routes import admin, agents, codec, health, invoke, metrics, requests, ui
from gateway_api.temporal_adapter import Finishes
from reach.config import ConfigError, ReachSettings
from reach.limits import Limits
from reach.process import settle_heap
from reach.security.auth import exposure_problem
from reach.security.guard import ConfigWatcher, Guard
from worker import (
    announce_retention,
    build_services,
    build_workers,
    ensure_search_attributes,
    running_workers,
)

log = logging.getLogger("reach.gateway")


class ReachApp(FastAPI):
    """FastAPI, with `POST /reach/invoke` answered ahead of its middleware stack.

    The invoke path has its own last-resort 500 envelope and body limit (`InvokeFastPath`), so
    it does not need Starlette's error middleware; skipping the stack saves its per-request
    wrapping of `send` (bench/invoke.py). Every other request goes through FastAPI as usual,
    and so do invokes while FastAPI's own HTTP telemetry is on (a global OpenTelemetry
    provider is set): they take the documented route then, and are counted with the rest.
    """

    fast: InvokeFastPath | None = None
    mcp: McpFront | None = None  # POST /mcp and its metadata document, likewise
    a2a: A2AFastPath | None = None  # POST /a2a/{capability}: the A2A front's calls, likewise
    beats: HeartbeatFastPath | None = None  # PUT /reach/agents/{id}/heartbeat, likewise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        said = self._from_a_page(scope)
        if said is not None:  # a web page driving a gateway that requires no tokens
            await browsers.refuse(send, said)
            return
        fast = self.fast
        if fast is not None and is_invoke(scope) and not self._framework_telemetry():
            await fast(scope, receive, send)
        elif self.mcp is not None and is_mcp(scope):
            await self.mcp(scope, receive, send)
        elif self.a2a is not None and is_a2a_call(scope) and not self._framework_telemetry():
            await self.a2a(scope, receive, send)
        elif (
            self.beats is not None
            and heartbeat_of(scope) is not None
            and not self._framework_telemetry()
        ):
            await self.beats(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def _from_a_page(self, scope: Scope) -> str | None:
        """Why a request is refused as a web page's (`gateway_api.browsers`), else None; the
        MCP front answers its own (as JSON-RPC errors)."""
        gateway = getattr(self.state, "gateway", None)
        if gateway is None or scope["type"] != "http" or is_mcp(scope):
            return None
        guard = gateway.guard
        if guard is not None and guard.auth.required:
            return None
        return browsers.refusal(gateway.settings, scope)

    def _framework_telemetry(self) -> bool:
        native = getattr(self, "_native_telemetry", None)  # FastAPI's, where it has one
        return native is not None and bool(native.enabled())


def create_app(
    settings: ReachSettings,
    client: Client,
    *,
    run_worker: bool = True,
    config_path: Path | None = None,
    own_process: bool = False,
) -> FastAPI:
    """The gateway app over a connected Temporal `client` (connect first, so an unreachable
    server is one clear error before anything serves). With `config_path`, a change to that
    file is applied without a restart (rules, limits, auth; R26). `own_process`: the app is
    the process's (`reach gateway`), which then settles its heap once started (`settle_heap`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        await ensure_search_attributes(client, client.namespace)
        await announce_retention(client, client.namespace)
        services = build_services(settings)
        await services.start()
        guard = Guard(settings, services.registry.store)
        await guard.start()
        problem = exposure_problem(settings.auth.mode, settings.listen_host, guard.auth.required)
        if problem is not None:
            await guard.aclose()
            await services.aclose()
            raise ConfigError(problem)
        if not guard.auth.required:
            log.warning(
                "no tokens: any process on this machine may invoke, register and answer; the "
                "gateway serves loopback only (%s). Issue tokens: reach tokens issue",
                settings.listen_host,
            )
        services.activities.audit = guard.audit  # a callback request's outcome record
        services.registry.on_evicted(
            lambda capability, instance: guard.audit.record(
                "evicted", capability=capability, instance=instance
            )
        )
        # A memory registry is invisible to other processes, so queue-mode capabilities are
        # served here too; with Redis, `worker.py --capability` processes serve them.
        queue_caps = (
            [n for n, c in settings.capabilities.items() if c.mode == "queue"]
            if settings.registry.type == "memory"
            else []
        )
        workers = build_workers(client, services, invoke=run_worker, capabilities=queue_caps)
        finishes = None
        if run_worker:  # the invoke worker is the first: its results are read as they land
            finishes = Finishes(task_timeout_s=settings.temporal.workflow_task_timeout_s)
            finishes.attach(workers[0])
        app.state.gateway = gateway = Gateway.build(
            settings,
            client,
            services.registry,
            services.activities.policy,
            view=services.view,
            router=services.router,
            resolver=services.activities.resolver,
            calls_here=run_worker,
            guard=guard,
            connections=services.connectors,
            metrics=services.metrics,
            finishes=finishes,
        )
        if finishes is not None and services.metrics is not None:
            services.metrics.watch(results=gateway.door.verdicts.counts)
        # Set when the server stops (http_limits): synchronous waits are then bounded.
        stopping = asyncio.Event()
        gateway.door.verdicts.drain(stopping, settings.transport.drain_s)
        watcher = None
        if config_path is not None:
            watcher = ConfigWatcher(guard, config_path, on_apply=gateway.reconfigure)
            watcher.start()
        app.state.config_watcher = watcher
        app.state.connectors = services.connectors
        # Instances registered by URL (reach.yaml `agents:` first): probed every interval.
        prober = Prober(gateway.agents.remote, settings)
        prober.start()
        try:
            # The gRPC front stops before the workers: its in-flight invokes need them.
            async with running_workers(workers), grpc_front.serving(settings, gateway) as front:
                app.state.grpc_port = front.port if front else None
                if own_process:
                    settle_heap()
                log.info(
                    "gateway ready on %s (registry=%s, task queue=%s)",
                    settings.gateway_url,
                    settings.registry.type,
                    settings.temporal.task_queue,
                )
                yield {DRAINING: stopping}  # into every request's state (uvicorn copies it)
        finally:
            gateway.door.verdicts.close()
            if finishes is not None:
                finishes.close()
            if watcher is not None:
                await watcher.aclose()
            await prober.aclose()
            await gateway.agents.remote.aclose()
            await guard.aclose()
            await services.aclose()

    app = ReachApp(
        title="Agent-Reach",
        version=reach.__version__,
        summary="Invoke agents by capability name, durably, over any protocol.",
        lifespan=lifespan,
        # A trailing slash is another path (404 in the envelope), not a bodiless 307.
        redirect_slashes=False,
    )
    install_error_handlers(app)
    limit = Limits(settings.transport.max_message_bytes).max_body_bytes
    app.add_middleware(BodyLimit, limit=limit)
    app.add_middleware(CatchBugs)
    app.fast = InvokeFastPath(app.state, limit)
    app.beats = HeartbeatFastPath(app.state, limit)
    app.mcp = McpFront(app.state, limit)  # the MCP front (gateway_api/mcp_front.py)
    app.include_router(invoke.router)
    app.include_router(requests.router)  # GET /reach/requests, .../{id}/timeline
    app.include_router(agents.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    if settings.metrics.enabled:
        app.include_router(metrics.router)  # GET /metrics (Prometheus)
    app.include_router(ui.router)  # the dashboard at /ui (not in the OpenAPI)
    # The A2A front: cards and JSON-RPC per capability (not in the OpenAPI).
    app.a2a = a2a_front.install(app, limit)
    if settings.security.encryption.enabled:
        app.include_router(codec.router(settings.security.encryption))
    return app
