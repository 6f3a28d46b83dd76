"""Step 6, plan: what this call may do (timeout, retries, idempotency, mode), decided once
from configuration by the policy engine and carried in the workflow input, so a replay
decides exactly as the original run did (`reach.policy.plan_call`)."""

from __future__ import annotations

from reach.config import ReachSettings
from reach.invocation import CallPlan
from reach.messages import InvokeRequest
from reach.policy import plan_call


def plan(settings: ReachSettings, request: InvokeRequest) -> CallPlan:
    call = plan_call(
        settings.policy,
        capability=request.target,
        operation=request.operation,
        timeout_ms=request.timeout_ms,
        idempotency_key=request.idempotency_key,
        mode=settings.capability_mode(request.target),
    )
    call.idempotency_ttl_s = settings.policy.idempotency_retention_s
    return call
