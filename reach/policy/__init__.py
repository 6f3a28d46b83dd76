"""Policy engine: what a request may do, decided in one place (R6, R13, R14, R15, R23).

`plan_call` runs once at acceptance and its result travels in the workflow input, so a replay
decides exactly as the original run did. `refine_plan` folds in what the agents declared at
Join (learnt at resolve, recorded in history), wherever configuration left a field open.
Whatever fails on the way, the workflow asks `reach.policy.retry` what to do next (try again:
when, where; wait for the store; give up: reporting what) and carries the answer out. All of
it is pure: no I/O, no clock, safe inside workflow code. The shared state (breakers,
ejections, buckets) is `reach.policy.state`; `reach.policy.engine` puts the two together for
the activities.
"""

from __future__ import annotations

from reach.config import PolicySettings
from reach.invocation import CallPlan, CapabilityMode
from reach.policy.retry import (
    KNOWN_CAPABILITY,
    LOST_RUN,
    NOT_SENT,
    QUEUE_DEADLINE,
    REDELIVER,
    STORE_WAIT,
    Attempts,
    Failure,
    GiveUp,
    Redeliver,
    Retry,
    RouteAgain,
    Rule,
    Step,
    WaitForStore,
    WaitForToken,
    after_failure,
    after_no_token,
    after_store_failure,
    backoff_s,
    next_step,
    timed_out,
)

__all__ = [
    "KNOWN_CAPABILITY",
    "LOST_RUN",
    "NOT_SENT",
    "QUEUE_DEADLINE",
    "REDELIVER",
    "STORE_WAIT",
    "Attempts",
    "Failure",
    "GiveUp",
    "Redeliver",
    "Retry",
    "RouteAgain",
    "Rule",
    "Step",
    "WaitForStore",
    "WaitForToken",
    "after_failure",
    "after_no_token",
    "after_store_failure",
    "backoff_s",
    "next_step",
    "plan_call",
    "refine_plan",
    "timed_out",
]


def plan_call(
    policy: PolicySettings,
    *,
    capability: str,
    operation: str,
    timeout_ms: int | None,
    idempotency_key: str | None,
    mode: CapabilityMode = "inline",
) -> CallPlan:
    """The plan from configuration: operation settings over capability settings over defaults.

    The deadline is the shorter of the caller's `timeout_ms` and the operation's timeout (R23);
    `default_timeout_ms` applies only when the caller gives none.
    """
    op = policy.operations.get(f"{capability}:{operation}")
    cap = policy.capabilities.get(capability)
    idempotent: bool | None = None
    op_timeout: int | None = None
    for layer in (op, cap):
        if layer is None:
            continue
        if idempotent is None:
            idempotent = layer.idempotent
        if op_timeout is None:
            op_timeout = layer.timeout_ms
    if idempotent is None and operation in policy.idempotent_operations:
        idempotent = True
    retry = policy.retry_for(capability, operation)
    configured_timeout = op_timeout is not None
    if op_timeout is not None:
        chosen = min(timeout_ms, op_timeout) if timeout_ms is not None else op_timeout
    else:  # the default is for callers who do not say; it caps nobody
        chosen = timeout_ms if timeout_ms is not None else policy.default_timeout_ms
    safe = bool(idempotent) or idempotency_key is not None
    # A caller that allows less than the operation's time cannot blame the agent for a timeout
    # (or any caller could open a capability's breaker with tiny deadlines).
    usual = op_timeout if op_timeout is not None else policy.default_timeout_ms
    return CallPlan(
        timeout_ms=chosen,
        idempotent=bool(idempotent),
        # Non-idempotent operations are retried only when the caller gave a key (R13).
        max_retries=retry.max_retries if safe else 0,
        mode=mode,
        backoff_base_ms=retry.backoff_base_ms,
        backoff_multiplier=retry.backoff_multiplier,
        backoff_cap_ms=retry.backoff_cap_ms,
        jitter=retry.jitter,
        idempotent_configured=idempotent is not None,
        timeout_configured=configured_timeout,
        retries_if_idempotent=retry.max_retries,
        caller_timeout_ms=timeout_ms,
        judge_timeouts=timeout_ms is None or timeout_ms >= usual,
    )


def refine_plan(
    plan: CallPlan,
    *,
    declared_idempotent: bool | None,
    declared_timeout_ms: int | None,
    accepted_at_ms: int,
    deadline_ms: int,
) -> tuple[CallPlan, int]:
    """Fold the agents' declarations into the plan where configuration was silent.

    Returns the plan and the deadline (never later than the one fixed at acceptance).
    """
    if not plan.idempotent_configured and declared_idempotent is not None:
        keyed_retries = plan.max_retries  # > 0 only when the caller gave a key
        plan = plan.model_copy(
            update={
                "idempotent": declared_idempotent,
                "max_retries": plan.retries_if_idempotent if declared_idempotent else keyed_retries,
                "idempotent_configured": True,
            }
        )
    if not plan.timeout_configured and declared_timeout_ms is not None:
        limit = declared_timeout_ms
        if plan.caller_timeout_ms is not None:
            limit = min(limit, plan.caller_timeout_ms)
        deadline_ms = min(deadline_ms, accepted_at_ms + limit)
        plan = plan.model_copy(update={"timeout_ms": min(plan.timeout_ms, limit)})
    return plan, deadline_ms
