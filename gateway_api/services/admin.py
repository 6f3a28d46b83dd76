"""What operators read of a running gateway: readiness, and a capability's policy and
routing state as the shared store holds them now."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from gateway_api.live import Live
from reach.policy.engine import PolicyEngine, capability_bucket
from reach.registry import Registry
from reach.routing import Router

# How long a readiness probe waits for Temporal before calling it down.
READY_CHECK_S = 2.0


class Views:
    def __init__(
        self,
        live: Live,
        client: Client,
        registry: Registry,
        policy: PolicyEngine,
        router: Router | None = None,
    ) -> None:
        self.live = live
        self.client = client
        self.registry = registry
        self.policy = policy
        self.router = router

    async def readiness(self) -> dict[str, bool]:
        """Whether Temporal and the registry store answer, each bounded in time."""
        checks: dict[str, bool] = {}
        try:
            checks["temporal"] = await asyncio.wait_for(
                self.client.service_client.check_health(), READY_CHECK_S
            )
        except (RPCError, TimeoutError):
            checks["temporal"] = False
        # The store's own socket timeout bounds this one (registry.redis_timeout_s).
        checks["registry"] = await self.registry.store.ping()
        return checks

    async def policy_detail(self, capability: str) -> dict[str, Any]:
        """Breaker, ejections and limiter as the shared store holds them now."""
        view = await self.policy.view(capability, fresh=True)
        limits = self.live.settings.policy.rate_limit_for(capability)
        limiter: dict[str, float] = {}
        if limits is not None and limits.per_capability is not None:
            limiter = await self.policy.state.buckets([capability_bucket(capability)])
        return {
            "breaker": {
                "status": view.breaker.status,
                "failures": view.breaker.failures,
                "retry_after_s": round(view.breaker.retry_after_s, 3),
            },
            "ejected": {i: round(left, 3) for i, left in view.ejected.items()},
            "limiter": limiter,
        }

    async def routing_detail(self, capability: str) -> dict[str, Any]:
        """The capability's routing configuration and its calls in flight."""
        routing = self.live.routing_for(capability)
        inflight: dict[str, int] = {}
        if self.router is not None:
            tracker = self.router.inflight
            await tracker.refresh(capability)
            inflight = dict(sorted(tracker.counts(capability).items()))
        strategy = routing.strategy or "round_robin"
        hashing = strategy == "consistent_hash"
        return {
            "strategy": strategy,
            "fallback": routing.fallback if hashing else None,
            "hash_on": (routing.hash_on or "routing_key") if hashing else None,
            "max_inflight": routing.max_inflight,
            "inflight": inflight,
        }
