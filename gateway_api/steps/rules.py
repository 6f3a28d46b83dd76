"""Step 3, rules (R19): may this caller call this operation? 403 names the rule.

Decided before anything is looked up, so a denied caller learns nothing of capabilities or
requests. A denial is audited by the guard (`denied`); an allowing rule may carry its own rate
limit, taken by the limits step.
"""

from __future__ import annotations

from reach.messages import InvokeRequest
from reach.security.guard import Guard
from reach.security.rules import Decision


def decide(guard: Guard | None, caller: str, request: InvokeRequest) -> Decision | None:
    """The allowing decision, or None on a bare gateway (no guard: no rules)."""
    if guard is None:
        return None
    return guard.decide(caller, request.target, request.operation, request.request_id)
