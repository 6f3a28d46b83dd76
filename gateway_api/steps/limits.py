"""Step 7, limits (R15, R19): take a token from every bucket that applies, or refuse (429
with Retry-After), or plan a durable wait for one (`on_limit: queue`).

Two kinds of bucket: the allowing rule's `rate_limit_per_minute` (per rule, caller and
capability, always refused), then the capability's own limits (`policy.rate_limits`). A repeat
that calls no agent (its RequestID exists, or its idempotency key holds a result for the same
payload) is never refused: it only reads what is already there.
"""

from __future__ import annotations

import math

from gateway_api.steps.known import Requests
from reach.config import LimitSettings, ReachSettings
from reach.errors import RateLimited
from reach.invocation import BucketPlan, CallPlan, QueuePlan, idempotency_scope, payload_fingerprint
from reach.messages import InvokeRequest
from reach.policy.engine import PolicyEngine, limit_buckets
from reach.security.rules import Decision
from reach.telemetry.metrics import ReachMetrics


class Limiter:
    def __init__(
        self, policy: PolicyEngine, requests: Requests, metrics: ReachMetrics | None = None
    ) -> None:
        self.policy = policy
        self.requests = requests
        self.metrics = metrics

    async def by_rule(self, request: InvokeRequest, caller: str, decision: Decision | None) -> None:
        """The allowing rule's rate_limit_per_minute, per caller and capability: 429."""
        if decision is None or decision.rate_limit_per_minute is None:
            return
        per_minute = decision.rate_limit_per_minute or 0.0
        bucket = BucketPlan(
            key=f"rule:{decision.rule}:{request.target}:{caller}",
            per_minute=per_minute,
            capacity=LimitSettings(per_minute=per_minute).capacity,
        )
        wait_s = await self.policy.take([bucket])
        if wait_s > 0 and not await self._calls_no_agent(request, caller):
            if self.metrics is not None:
                self.metrics.rate_limited(request.target, "reject")
            raise RateLimited(
                f"rule {decision.rule!r} allows caller {caller!r} {per_minute:g} calls a minute "
                f"to {request.target!r}; a token frees in {wait_s:.1f}s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )

    async def by_capability(
        self,
        settings: ReachSettings,
        request: InvokeRequest,
        caller: str,
        plan: CallPlan,
        now_ms: int,
    ) -> None:
        """The capability's limits: a token, or 429, or a queue plan on `plan`."""
        limits = settings.policy.rate_limit_for(request.target)
        if limits is None:
            return
        buckets = limit_buckets(limits, request.target, caller)
        wait_s = await self.policy.take(buckets)
        if wait_s <= 0 or await self._calls_no_agent(request, caller):
            return
        if self.metrics is not None:
            self.metrics.rate_limited(request.target, limits.on_limit)
        if limits.on_limit == "reject":
            raise RateLimited(
                f"rate limit of capability {request.target!r} for caller {caller!r} reached; "
                f"a token frees in {wait_s:.1f}s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )
        # Queue: the request waits for a token inside its workflow, on durable timers; a
        # synchronous one until its deadline, one with a callback up to max_queue_wait_ms.
        until = now_ms + (limits.max_queue_wait_ms if request.callback else plan.timeout_ms)
        plan.queue = QueuePlan(buckets=buckets, wait_until_ms=until)

    async def _calls_no_agent(self, request: InvokeRequest, caller: str) -> bool:
        """Whether a request the limiter would refuse is a repeat that calls no agent. Asked
        only when the limit is reached."""
        if request.request_id and await self.requests.exists(request.request_id):
            return True
        if not request.idempotency_key:
            return False
        scope = idempotency_scope(
            caller, request.target, request.operation, request.idempotency_key
        )
        held = await self.policy.state.peek(scope)
        return held is not None and held.partition(" ")[2] == payload_fingerprint(request.payload)
