"""The FastAPI application factory. Nothing is built at import time:
`create_app(settings, client)` wires everything in the lifespan, so tests and several
processes configure their own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from temporalio.client import Client

import reach
from gateway_api import grpc_front
from gateway_api.errors import BodyLimit, CatchBugs, install_error_handlers
from gateway_api.fast import InvokeFastPath
from gateway_api.routes import agents, health, invoke
from gateway_api.service import Gateway
from reach.config import ReachSettings
from reach.limits import Limits
from worker import (
    announce_retention,
    build_services,
    build_workers,
    ensure_search_attributes,
    running_workers,
)

log = logging.getLogger("reach.gateway")


def create_app(settings: ReachSettings, client: Client, *, run_worker: bool = True) -> FastAPI:
    """The gateway app over a connected Temporal `client` (connect first, so an unreachable
    server is one clear error before anything serves)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ensure_search_attributes(client, client.namespace)
        await announce_retention(client, client.namespace)
        services = build_services(settings)
        await services.start()
        # A memory registry is invisible to other processes, so queue-mode capabilities are
        # served here too; with Redis, `worker.py --capability` processes serve them.
        queue_caps = (
            [n for n, c in settings.capabilities.items() if c.mode == "queue"]
            if settings.registry.type == "memory"
            else []
        )
        workers = build_workers(client, services, invoke=run_worker, capabilities=queue_caps)
        app.state.gateway = gateway = Gateway(
            settings,
            client,
            services.registry,
            services.activities.policy,
            services.view,
            services.router,
            services.activities.resolver,
            calls_here=run_worker,
        )
        app.state.connectors = services.connectors
        try:
            # The gRPC front stops before the workers: its in-flight invokes need them.
            async with running_workers(workers), grpc_front.serving(settings, gateway) as front:
                app.state.grpc_port = front.port if front else None
                log.info(
                    "gateway ready on %s (registry=%s, task queue=%s)",
                    settings.gateway_url,
                    settings.registry.type,
                    settings.temporal.task_queue,
                )
                yield
        finally:
            await services.aclose()

    app = FastAPI(
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
    app.add_middleware(InvokeFastPath, state=app.state, limit=limit)
    app.include_router(invoke.router)
    app.include_router(agents.router)
    app.include_router(health.router)
    return app
