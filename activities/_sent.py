"""Sent once: an attempt for an agent that would run it twice is claimed before it is sent.

Temporal runs an activity at least once. When the process running a call stops before its
answer is recorded, another gateway replays the request and runs the same attempt again, to the
same instance (a re-run goes back where the first run went, `reach.resolve.check_first`). An
agent speaking Reach's contract answers a RequestID it has seen from its answer cache (R8); an
MCP server or an A2A agent runs it again (`Connector.deduplicates` is False). So before such an
attempt is sent, unless its operation may run twice, "attempt N of request R is sent" is claimed
in the policy state every gateway shares (Redis when they share one, else this process's
memory), kept past the request's deadline. A run that finds the claim made by another run does
not send: the earlier one may have run it, and the request ends with that unknown outcome.

The claim costs one store round trip, and only on calls to such agents: a connector that
deduplicates costs nothing here (no claim, no store access).
"""

from __future__ import annotations

import time
import uuid

from temporalio import activity

from reach.config import PolicySettings
from reach.errors import ReachError, TransportError, Unavailable
from reach.invocation import CallInput
from reach.policy import plan_call
from reach.policy.state import PolicyState

SENT_KEPT_S = 300.0
"""A claimed send is kept this long past the request's deadline (or the attempt's timeout)."""


_WHO = {"mcp": "An MCP server", "a2a": "An A2A agent"}


class NotSent(Exception):
    """A call refused before it was sent: `err` is the request's failure, not the agent's
    (nothing is counted against it)."""

    def __init__(self, err: ReachError) -> None:
        super().__init__(err.message)
        self.err = err


def sent_key(request_id: str, attempt: int) -> str:
    """The claim's key in the policy state (idempotency keys are `idem:...`)."""
    return f"sent:{request_id}:{attempt}"


def idempotent(policy: PolicySettings, inp: CallInput) -> bool:
    """Whether the call's operation may run twice: as configured (`policy`), else as its agent
    declared it; undeclared is not."""
    endpoint = inp.endpoint
    plan = plan_call(
        policy,
        capability=endpoint.capability,
        operation=inp.message.header.operation,
        timeout_ms=None,
        idempotency_key=None,
    )
    return plan.idempotent if plan.idempotent_configured else endpoint.declared_idempotent is True


def _may_follow_a_send(inp: CallInput) -> bool:
    """Whether an earlier run of this very call may have sent it: a local activity is run again,
    silently, when the workflow task that ran it was lost (its process stopped, or its
    completion was refused), unless the workflow says nothing can have been sent before: this
    is its first task (the door's route), or the attempt was routed in this very task by a
    resolve that found no other run's pin (`routed_here`: every run that sends a routed
    attempt pins it first, so a lost one would have left its pin). A regular activity runs
    once per scheduling, unless Temporal retried it (`attempt` > 1: the one before timed out
    without reporting, and may have sent it)."""
    try:
        info = activity.info()
    except RuntimeError:  # called outside an activity (tests)
        return False
    if info.attempt > 1:
        return True
    if inp.check_first and inp.first_run:
        return False
    return info.is_local and not inp.routed_here


async def claim_send(state: PolicyState, inp: CallInput) -> None:
    """Claim this run's send of the attempt, or raise `NotSent`: another run claimed it (its
    process stopped; the agent may have run the call), or the claim could not be made (the
    store is down: nothing is sent unchecked; if an earlier run may have sent it, the outcome
    is unknown, and said so: the reliability suite found a re-run that answered a plain
    `unavailable` for a tool the MCP server had run)."""
    header, endpoint = inp.message.header, inp.endpoint
    now_ms = time.time() * 1000
    until_ms = max(header.deadline_ms or 0, now_ms + inp.timeout_ms)
    mine = f"{uuid.uuid4().hex} {int(now_ms)}"
    ttl_s = (until_ms - now_ms) / 1000 + SENT_KEPT_S
    try:
        held = await state.claim(sent_key(header.request_id, header.attempt), mine, ttl_s)
    except ReachError as err:
        unknown = _may_follow_a_send(inp)
        raise NotSent(
            Unavailable(
                f"attempt {header.attempt} was not sent to {endpoint.instance_id}: whether an "
                f"earlier run sent it could not be checked ({err.message})"
                + ("; one may have, so the agent may have run it" if unknown else ""),
                retryable=False if unknown else None,
                outcome_unknown=True if unknown else None,
            )
        ) from err
    if held == mine:
        return
    _, _, at_ms = held.partition(" ")
    ago = f" {max(0.0, (now_ms - int(at_ms)) / 1000):.1f} s ago" if at_ms.isdigit() else ""
    raise NotSent(
        TransportError(
            f"attempt {header.attempt} was sent to {endpoint.instance_id}{ago} by a run whose "
            "Reach process stopped before its answer was recorded; the agent may have run it. "
            f"{_WHO.get(endpoint.protocol, 'Its agent')} does not deduplicate by RequestID and "
            f"{header.operation!r} is not declared idempotent, so it is not sent again",
            retryable=False,
            outcome_unknown=True,
        )
    )
