"""A gateway process's parts, as the fronts and routes reach them.

    door      every invoke (gateway_api.door)
    agents    join, heartbeat, leave (services/agents.py)
    requests  status, delivery, late answers (services/requests.py)
    views     readiness, a capability's policy and routing state (services/admin.py)
    guard     tokens, rules, audit (reach.security.guard)

Built once in the app's lifespan (`Gateway.build`); a reload replaces the settings in force
for all of them at once (`reconfigure`).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.client import Client

from connectors import ConnectorSet
from gateway_api.door import Door
from gateway_api.engine import Engine
from gateway_api.live import Live
from gateway_api.services.admin import Views
from gateway_api.services.agents import Agents
from gateway_api.services.requests import Requests
from gateway_api.steps.known import Capabilities
from gateway_api.steps.limits import Limiter
from gateway_api.steps.route import FirstRoute
from gateway_api.steps.wait import Verdicts
from gateway_api.temporal_adapter import Finishes
from reach.config import ReachSettings
from reach.limits import Limits
from reach.policy.engine import PolicyEngine
from reach.registry import Registry
from reach.registry.view import RegistryView
from reach.resolve import Resolver
from reach.routing import Router
from reach.security.guard import Guard
from reach.telemetry.metrics import ReachMetrics


class Gateway:
    def __init__(
        self,
        live: Live,
        engine: Engine,
        registry: Registry,
        door: Door,
        agents: Agents,
        requests: Requests,
        views: Views,
        guard: Guard | None = None,
        metrics: ReachMetrics | None = None,
    ) -> None:
        self.live = live
        self.engine = engine
        self.registry = registry
        self.door = door
        self.agents = agents
        self.requests = requests
        self.views = views
        self.guard = guard
        self.metrics = metrics

    @classmethod
    def build(
        cls,
        settings: ReachSettings,
        client: Client,
        registry: Registry,
        policy: PolicyEngine,
        *,
        view: RegistryView | None = None,
        router: Router | None = None,
        resolver: Resolver | None = None,
        calls_here: bool = False,
        guard: Guard | None = None,
        connections: ConnectorSet | None = None,
        metrics: ReachMetrics | None = None,
        finishes: Finishes | None = None,
    ) -> Gateway:
        """`view`: the local registry view (else the store each time); `resolver` routes
        attempt 1 at the door (else each workflow resolves it); `calls_here`: this process
        runs the invoke worker; `finishes`: results its worker records, read without a long
        poll. None for the optional parts: a bare gateway (tests)."""
        live = Live(settings)
        rpc_timeout = timedelta(seconds=settings.temporal.rpc_timeout_s)
        engine = Engine(
            client,
            settings.temporal.task_queue,
            rpc_timeout,
            timedelta(seconds=settings.temporal.workflow_task_timeout_s),
        )
        capabilities = Capabilities(registry, view)
        door = Door(
            live,
            engine,
            capabilities,
            Limiter(policy, engine, metrics),
            FirstRoute(resolver, calls_here=calls_here),
            Verdicts(engine, finishes),
            guard,
            metrics,
        )
        return cls(
            live,
            engine,
            registry,
            door,
            Agents(live, registry, guard, connections, metrics),
            Requests(engine, registry, guard),
            Views(live, client, registry, policy, router),
            guard,
            metrics,
        )

    @property
    def settings(self) -> ReachSettings:
        return self.live.settings

    @property
    def limits(self) -> Limits:
        return self.live.limits

    @property
    def client(self) -> Client:
        return self.engine.client

    @property
    def rpc_timeout(self) -> timedelta:
        return self.engine.rpc_timeout

    def reconfigure(self, settings: ReachSettings) -> None:
        """A reloaded configuration (validated), in force from the next request on: plans,
        limits and routing (the strategy each capability routes by here)."""
        self.live.reconfigure(settings)
        if self.views.router is not None:
            self.views.router.reconfigure(self.live.routing_for)
