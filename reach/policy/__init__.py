"""Policy engine: what a request may do, decided in one place (R6, R13, R23).

`plan_call` runs once at acceptance and its result travels in the workflow input, so a replay
decides exactly as the original run did. `next_step` is the one question the workflow asks after
a failed attempt. Both are pure functions: no I/O, no clock, safe inside workflow code.
"""

from __future__ import annotations

from dataclasses import dataclass

from reach.config import PolicySettings
from reach.invocation import CallPlan, CapabilityMode


def plan_call(
    policy: PolicySettings,
    *,
    capability: str,
    operation: str,
    timeout_ms: int | None,
    idempotency_key: str | None,
    mode: CapabilityMode = "inline",
) -> CallPlan:
    op = policy.operations.get(f"{capability}:{operation}")
    declared = op.idempotent if op and op.idempotent is not None else None
    idempotent = declared if declared is not None else operation in policy.idempotent_operations
    if timeout_ms is None:
        timeout_ms = op.timeout_ms if op and op.timeout_ms else policy.default_timeout_ms
    # Non-idempotent operations are retried only when the caller gave a key to dedupe on (R13).
    retries = policy.default_retry if (idempotent or idempotency_key) else 0
    return CallPlan(
        timeout_ms=timeout_ms,
        idempotent=idempotent,
        max_retries=retries,
        backoff_s=list(policy.backoff_s),
        mode=mode,
    )


@dataclass(frozen=True)
class Retry:
    delay_s: float
    avoid_instance: str | None


@dataclass(frozen=True)
class GiveUp:
    reason: str


def next_step(
    plan: CallPlan,
    *,
    attempt: int,
    retryable: bool,
    failed_instance: str | None,
    now_ms: int,
    deadline_ms: int,
) -> Retry | GiveUp:
    """After attempt number `attempt` (1-based) failed: try again, or give up and report."""
    if not retryable:
        return GiveUp("the error is not retryable")
    if attempt > plan.max_retries:
        return GiveUp(f"{plan.max_retries} retries used")
    backoff = plan.backoff_s or [1.0]
    delay = backoff[min(attempt - 1, len(backoff) - 1)]
    if now_ms + delay * 1000 >= deadline_ms:
        return GiveUp("no time left before the deadline for another attempt")
    return Retry(delay_s=delay, avoid_instance=failed_instance)
